"""The tutorials: every notebook runs top to bottom in a real kernel, and is stored clean.

The notebooks assert their own results (weights equal to Keras's, resumed equal to
uninterrupted, ...), so a broken feature fails the cell that shows it. They launch `mpirun`
themselves and work in a temporary folder.
"""

import json
import os
import pathlib
import sys

import pytest

pytestmark = pytest.mark.mpi  # every test here starts MPI jobs

REPO = pathlib.Path(__file__).resolve().parent.parent
TUTORIALS = REPO / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
KERNEL_NAME = "hyparflow-tutorials"
CELL_TIMEOUT = 300  # seconds; the slowest cells launch mpirun (5-30 s on 2 busy cores)
KERNEL_START_TIMEOUT = 120


def _code_cells(path):
    with open(path) as f:
        notebook = json.load(f)
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_the_seven_tutorials_are_listed_in_the_readme():
    names = [path.name for path in NOTEBOOKS]
    assert len(names) == 7, names
    assert names[-1] == "07_mixture_of_experts.ipynb", names
    readme = (TUTORIALS / "README.md").read_text()
    for name in names:
        assert name in readme, f"tutorials/README.md does not mention {name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    for index, cell in enumerate(_code_cells(path)):
        assert cell.get("outputs") == [], f"{path.name}: code cell {index} has outputs"
        assert cell.get("execution_count") is None, f"{path.name}: cell {index} was executed"


@pytest.fixture(scope="module")
def kernel_spec_dir(tmp_path_factory):
    """A kernel spec that starts this very Python (the project's .venv under `make test`), with
    the checkout importable, so the notebooks test this code and not another install."""
    folder = tmp_path_factory.mktemp("kernels")
    spec = folder / KERNEL_NAME
    spec.mkdir()
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    spec_json = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hyparflow tutorials (test)",
        "language": "python",
        "env": {"PYTHONPATH": python_path},
    }
    (spec / "kernel.json").write_text(json.dumps(spec_json))
    return folder


def _execute(notebook, kernel_spec_dir, cwd):
    """Run every cell in a fresh kernel; raises nbclient's CellExecutionError on a failing cell."""
    pytest.importorskip("ipykernel", reason="the tutorials need the notebooks extra")
    nbclient = pytest.importorskip("nbclient", reason="the tutorials need the notebooks extra")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    specs = KernelSpecManager(kernel_dirs=[str(kernel_spec_dir)], ensure_native_kernel=False)
    manager = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)
    client = nbclient.NotebookClient(
        notebook,
        km=manager,
        timeout=CELL_TIMEOUT,
        startup_timeout=KERNEL_START_TIMEOUT,
        resources={"metadata": {"path": str(cwd)}},
    )
    client.execute()
    return notebook


def test_the_kernel_is_this_python(kernel_spec_dir, tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="the tutorials need the notebooks extra")
    cell = nbformat.v4.new_code_cell("import sys, hyparflow\nprint(sys.executable)")
    notebook = _execute(nbformat.v4.new_notebook(cells=[cell]), kernel_spec_dir, tmp_path)
    printed = "".join(o.get("text", "") for o in notebook.cells[0].outputs).strip()
    assert printed == sys.executable


def _files_under(folder):
    return {p for p in folder.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_spec_dir):
    nbformat = pytest.importorskip("nbformat", reason="the tutorials need the notebooks extra")
    notebook = nbformat.read(path, as_version=4)
    before = _files_under(TUTORIALS)
    _execute(notebook, kernel_spec_dir, TUTORIALS)
    errors = [
        output
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors, errors
    assert _files_under(TUTORIALS) == before, "the notebook left files in tutorials/"
