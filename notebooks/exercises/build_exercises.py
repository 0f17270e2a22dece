"""Writes the exercise notebooks in notebooks/exercises/ from `labkit.exercises` (one notebook per
exercise: the scenario, one `parameters` cell, the graded check, a widget to try again).
Edit the exercises in labkit/exercises.py, then run `python notebooks/exercises/build_exercises.py`
(outputs are never committed). Answer keys: `papermill NB.ipynb key.ipynb -p solution True`."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from labkit import exercises

ROOT = Path(__file__).resolve().parent
KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"}}

PARAMETERS = '''prediction = None  # your answer: {KIND}
solution = False  # True: fill in the reference answer and grade it (an answer key)
device = "auto"  # auto, cpu, cuda or cuda:N: where the experiment runs
runs_dir = None  # where runs are stored and reused (None: $LABKIT_RUNS_DIR or ./runs)
interactive = True  # show the answer box and the Check button'''

GRADE = '''if prediction is None and not solution:
    print("Enter your prediction in the box below, or set `prediction` above and run again.")
else:
    outcome = exercises.check({KEY!r}, prediction, solution=solution, device=device,
                              runs_dir=runs_dir)
    print(outcome.report())'''

HOW = {"formula": "The reference answer comes from the formula (the planner or the experiment's "
                  "napkin math), computed before anything is measured; the measurement is the evidence.",
       "measurement": "There is no formula for this on your machine: your prediction is graded "
                      "against the measurement. Solution mode enters the textbook answer and grades "
                      "it against the measurement too.",
       "fault": "This setup is broken on purpose: read the evidence and name the fault."}


def kind(ex: exercises.Exercise) -> str:
    if ex.choices:
        return "one of " + ", ".join(repr(c) for c in ex.choices)
    return f"a number in {ex.unit}" if ex.unit else "a number"


def exercise_notebook(ex: exercises.Exercise) -> nbformat.NotebookNode:
    intro = (f"# {ex.title}\n\n*Topic: {ex.topic}.*\n\n{ex.scenario}\n\n**Question:** {ex.question}\n\n"
             f"**Answer:** {ex.tolerance_words()}.\n\n{HOW[ex.graded_against]}")
    parameters = new_code_cell(PARAMETERS.replace("{KIND}", kind(ex)), metadata={"tags": ["parameters"]})
    return new_notebook(metadata=KERNEL, cells=[
        new_markdown_cell(intro),
        parameters,
        new_markdown_cell("## The setup"),
        new_code_cell(f"from labkit import exercises\n\nprint(exercises.describe({ex.key!r}, device))"),
        new_markdown_cell("## Predict, then measure: the experiment runs on your device and grades "
                          "your prediction"),
        new_code_cell(GRADE.replace("{KEY!r}", repr(ex.key))),
        new_markdown_cell("## Try an answer"),
        new_code_cell("if interactive:\n"
                      f"    display(exercises.widget({ex.key!r}, device=device, runs_dir=runs_dir))"),
    ])


def notebook_names() -> dict[str, exercises.Exercise]:
    """`NN_key.ipynb`, numbered in the order of labkit.exercises.EXERCISES."""
    return {f"{i:02d}_{key}.ipynb": ex for i, (key, ex) in enumerate(exercises.EXERCISES.items(), 1)}


if __name__ == "__main__":
    for filename, ex in notebook_names().items():
        nb = exercise_notebook(ex)
        for i, cell in enumerate(nb.cells):
            cell.id = f"cell-{i:02d}"  # stable ids: a rebuild changes only what was edited
        nbformat.validate(nb)
        nbformat.write(nb, ROOT / filename)
        print("wrote", ROOT / filename)
