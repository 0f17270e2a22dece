"""One kernel for notebook after notebook (labkit.report.kernel): a notebook sees none of the last
one's names, multiprocessing still starts processes after the reset, the kernel's stderr is
logged under each notebook's name, and a notebook that kills its kernel fails alone."""
import pytest

from conftest import needs

from labkit.report.kernel import WarmKernel

pytestmark = needs("papermill", "nbformat")


def notebook(folder, name, *sources):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 0", metadata={"tags": ["parameters"]})]
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path = folder / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def printed(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.notebook
def test_warmed_kernel_forgets_names_keeps_modules_replaces_a_dead_one(tmp_path, monkeypatch):
    import papermill

    first = notebook(tmp_path, "first", "import os, sys, torch\nleft = 41\n"
                     "sys.stderr.write('to the log\\n')\nos.write(2, b'fd two\\n')\n"
                     "print('pid', os.getpid(), 'threads', torch.get_num_threads())\n"
                     "print('warm', 'labkit.harness.experiment' in sys.modules)\n"
                     "import nbformat\nprint('grammar', 'rfc3987_syntax.syntax_helpers' in sys.modules)")
    second = notebook(tmp_path, "second", "import os, multiprocessing as mp\n"
                      "print('left' in globals(), x)\n"
                      "p = mp.get_context('spawn').Process(target=print)\np.start(); p.join()\n"
                      "print('exit', p.exitcode, 'pid', os.getpid())")
    dies = notebook(tmp_path, "dies", "import os\nos._exit(3)")
    log = tmp_path / "logs" / "kernel.log"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with WarmKernel(tmp_path, log, threads=1) as kernel:  # its slot's share of the cores
        kernel.warm()  # started, labkit imported: before the first notebook
        kernel.execute(first, tmp_path / "out1.ipynb", {"x": 1})
        kernel.execute(second, tmp_path / "out2.ipynb", {"x": 2})
        with pytest.raises(Exception) as died:
            kernel.execute(dies, tmp_path / "out3.ipynb", {})
        assert not isinstance(died.value, papermill.PapermillExecutionError)
        kernel.execute(second, tmp_path / "out4.ipynb", {"x": 4})
    text = printed(tmp_path / "out1.ipynb")
    pid, threads = (text.split(f"{name} ")[1].split()[0] for name in ("pid", "threads"))
    assert threads == "1"  # one thread, on a machine of any number of cores
    assert "warm True" in text  # imported by warm(), not by the notebook
    assert "grammar False" in text  # deferred as the kernel started (defer_iri_grammar)
    assert printed(tmp_path / "out2.ipynb").split() == ["False", "2", "exit", "0", "pid", pid]
    again = printed(tmp_path / "out4.ipynb").split()
    assert again[:4] == ["False", "4", "exit", "0"] and again[5] != pid  # a fresh kernel
    text = log.read_text()
    order = [text.index(part) for part in ("--- (start)", "--- first", "fd two", "--- second")]
    assert order == sorted(order)
    assert text.count("--- second") == 2 and "--- dies" in text


IRIS = ("http://a.b/c d", "http://例え.jp/パス")  # a space is not allowed in an IRI; Unicode is


@pytest.mark.slow  # the grammar is built here: over a second
def test_the_iri_grammar_is_built_on_first_use_and_answers_as_the_real_one(monkeypatch):
    """What jsonschema imports from the stand-in is there with no grammar built; its first call
    builds it and answers as the real module."""
    import sys

    from labkit.report.kernel import IRI_MODULE, defer_iri_grammar

    for name in (IRI_MODULE, f"{IRI_MODULE}.syntax_helpers"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # put back after the test
    defer_iri_grammar()
    from rfc3987_syntax import is_valid_syntax  # what jsonschema's format checks import

    assert f"{IRI_MODULE}.syntax_helpers" not in sys.modules
    answers = [bool(is_valid_syntax("iri", v)) for v in IRIS]
    real = sys.modules[IRI_MODULE]  # the first call loaded it in the stand-in's place
    assert f"{IRI_MODULE}.syntax_helpers" in sys.modules and real.is_valid_syntax is not is_valid_syntax
    assert answers == [False, True] == [bool(real.is_valid_syntax("iri", v)) for v in IRIS]
