"""Writes the exercise notebooks in notebooks/exercises/ from `labkit.study.exercises` (one notebook per
exercise: the scenario, one `parameters` cell, the graded check, a widget to try again), then one
per troubleshooting lab (`labkit.study.exercises.labs.LABS`: symptoms, evidence, diagnosis, fix).
Edit the words in notebooks/exercises/text/KEY.md (the format: `labkit.study.exercises.text`)
and the mechanism in labkit/study/exercises/ (a module per topic), then run
`python notebooks/exercises/build_exercises.py` (outputs are never committed). Answer keys:
`papermill NB.ipynb key.ipynb -p solution True`."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from labkit.study import exercises
from labkit.study.exercises import labs

ROOT = Path(__file__).resolve().parent
KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"}}

PARAMETERS = '''prediction = None  # your answer: {KIND}
solution = False  # True: fill in the reference answer and grade it (an answer key)
device = "auto"  # auto, cpu, cuda or cuda:N: where the experiment runs
runs_dir = None  # where runs are stored and reused (None: $LABKIT_RUNS_DIR or ./runs)
interactive = True  # show the answer box and the Check button
show_hint = False  # True: print a hint towards the method (the answer stays hidden)'''

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


def exercise_notebook(ex: exercises.Exercise | labs.Lab) -> nbformat.NotebookNode:
    """An exercise's notebook (a lab's: `lab_notebook`)."""
    if isinstance(ex, labs.Lab):
        return lab_notebook(ex)
    level = f"level {ex.level} of 3: {exercises.LEVELS[ex.level]}"
    cpu = f"**What a CPU cannot show.** {ex.cpu}\n\n" if ex.cpu else ""
    intro = (f"# {ex.title}\n\n*Topic: {ex.topic}; {level}.*\n\n{cpu}{ex.scenario}\n\n"
             f"**Question:** {ex.question}\n\n**Answer:** {ex.tolerance_words()}.\n\n{HOW[ex.graded_against]}")
    parameters = new_code_cell(PARAMETERS.replace("{KIND}", kind(ex)), metadata={"tags": ["parameters"]})
    return new_notebook(metadata=KERNEL, cells=[
        new_markdown_cell(intro),
        parameters,
        new_markdown_cell("## The setup"),
        new_code_cell(f"from labkit.study import exercises\n\nprint(exercises.describe({ex.key!r}, device))"),
        new_markdown_cell("## A hint, if you want one (before you answer)"),
        new_code_cell(f"if show_hint:\n    print(exercises.hint({ex.key!r}))"),
        new_markdown_cell("## Predict, then measure: the experiment runs on your device and grades "
                          "your prediction"),
        new_code_cell(GRADE.replace("{KEY!r}", repr(ex.key))),
        new_markdown_cell("## Try an answer"),
        new_code_cell("if interactive:\n"
                      f"    display(exercises.widget({ex.key!r}, device=device, runs_dir=runs_dir))"),
    ])


LAB_PARAMETERS = '''diagnosis = None  # your diagnosis: one of labs.DIAGNOSES (or a list: attempts in order)
fix = None  # your fix, after the diagnosis: a dict of one knob and its value (the knobs come then)
solution = False  # True: the reference diagnosis and fix, graded (an answer key)
device = "auto"  # auto, cpu, cuda or cuda:N: where the setup runs
runs_dir = None  # where runs and attempts are stored and reused (None: $LABKIT_RUNS_DIR or ./runs)
interactive = True  # show the diagnosis dropdown, then the knob controls and the Apply button'''

LAB_DIAGNOSE = '''if solution:
    print(labs.diagnose({KEY!r}, solution=True).report())
elif diagnosis is None:
    print("Choose a diagnosis in the dropdown below, or set `diagnosis` above and run again.")
else:
    for attempt in [diagnosis] if isinstance(diagnosis, str) else diagnosis:
        print(labs.diagnose({KEY!r}, attempt, device=device, runs_dir=runs_dir,
                            evidence=evidence).report(), "\\n")'''

LAB_FIX = '''if solution or fix is not None:
    print(labs.apply_fix({KEY!r}, fix, solution=solution, device=device, runs_dir=runs_dir).report())
elif diagnosis is not None:
    print(labs.knobs({KEY!r}))
    print("Set `fix` above (one knob and its value) and run again, or use the controls below.")
else:
    print("Diagnose first (above): the fix knobs are shown after a diagnosis.")'''


def lab_notebook(lab: labs.Lab) -> nbformat.NotebookNode:
    """Symptoms, the measured evidence, the graded diagnosis, the fix measured again and graded."""
    intro = (f"# Troubleshooting lab: {lab.title}\n\n*Level {lab.level} of 3: "
             f"{exercises.LEVELS[lab.level]}.*\n\n" + (f"**What a CPU cannot show.** {lab.cpu}\n\n"
                                                         if lab.cpu else "")
             + "A colleague reports a symptom. Read the measured evidence and name the cause; then "
             "labkit shows its fix knobs (the same for every lab): change one, labkit measures the "
             "setup again and grades the fix by the figure of the mechanism, with a stated margin.")
    code = {name: text.replace("{KEY!r}", repr(lab.key)) for name, text in
            (("diagnose", LAB_DIAGNOSE), ("fix", LAB_FIX))}
    return new_notebook(metadata=KERNEL, cells=[
        new_markdown_cell(intro),
        new_code_cell(LAB_PARAMETERS, metadata={"tags": ["parameters"]}),
        new_markdown_cell("## What is reported"),
        new_code_cell(f"from labkit.study.exercises import labs\n\nprint(labs.symptoms({lab.key!r}, device))"),
        new_markdown_cell("## The evidence, measured on your device"),
        new_code_cell(f"evidence = labs.investigate({lab.key!r}, device, runs_dir)\nprint(evidence.report())"),
        new_markdown_cell("## Your diagnosis"),
        new_code_cell(code["diagnose"]),
        new_markdown_cell("## The fix knobs, then your fix: measured again and graded"),
        new_code_cell(code["fix"]),
        new_markdown_cell("## Try it"),
        new_code_cell(f"if interactive:\n    display(labs.widget({lab.key!r}, device=device, runs_dir=runs_dir))"),
    ])


def notebook_names() -> dict[str, exercises.Exercise | labs.Lab]:
    """`NN_key.ipynb`, numbered in the order of labkit.study.exercises.EXERCISES, then the labs (LABS)."""
    items = [*exercises.EXERCISES.items(), *labs.LABS.items()]
    return {f"{i:02d}_{key}.ipynb": item for i, (key, item) in enumerate(items, 1)}


if __name__ == "__main__":
    names = notebook_names()
    for stale in set(p.name for p in ROOT.glob("[0-9][0-9]_*.ipynb")) - set(names):
        (ROOT / stale).unlink()  # renumbered or removed exercises
        print("removed", ROOT / stale)
    for filename, ex in names.items():
        nb = exercise_notebook(ex)
        for i, cell in enumerate(nb.cells):
            cell.id = f"cell-{i:02d}"  # stable ids: a rebuild changes only what was edited
        nbformat.validate(nb)
        nbformat.write(nb, ROOT / filename)
        print("wrote", ROOT / filename)
