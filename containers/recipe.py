"""HPC Container Maker recipe: hyparflow images, CPU (distribution Open MPI) or GPU (CUDA-aware).

Generate with `python containers/generate.py` (writes the committed Dockerfiles and Singularity
definitions), or with hpccm's own command line:
    hpccm --recipe containers/recipe.py --userarg variant=gpu --format singularity
Both build from the repository root (the hyparflow sources are copied from there).
`--userarg base=IMAGE` swaps the CPU image's base for another apt-based one: `make image` builds
on a Debian 12 root made locally with debootstrap (scripts/image_build.sh), where no registry
serves `ubuntu:24.04`. The published recipes keep their base.
"""

from hpccm import Stage
from hpccm.building_blocks import gdrcopy, ofed, openmpi, packages, pip, ucx
from hpccm.primitives import baseimage, comment, copy, environment, label, shell

CPU_IMAGE = "ubuntu:24.04"
GPU_IMAGE = "nvcr.io/nvidia/cuda:12.8.1-devel-ubuntu24.04"
OPENMPI_VERSION = "4.1.8"  # the 4.1 series, like the distributions' Open MPI (ABI-compatible)
UCX_VERSION = "1.18.0"
GDRCOPY_VERSION = "2.4.4"
VENV = "/opt/venv"
SOURCE = "/opt/hyparflow"
# The versions hyparflow is tested with (pyproject.toml allows a range).
PYTHON_PACKAGES = {
    "cpu": ["tensorflow==2.21.0", "keras==3.15.1", "h5py==3.14.0"],
    "gpu": ["tensorflow[and-cuda]==2.21.0", "keras==3.15.1", "h5py==3.14.0"],
}
MPI4PY_VERSION = "4.1.2"
# To build Python packages against the image's MPI and run `mpirun` (ssh for multi-node starts).
BUILD_PACKAGES = ["build-essential", "openssh-client", "python3-dev", "python3-venv"]


def cpu_mpi() -> list:
    """The distribution's Open MPI: the same family the host's Open MPI usually is."""
    return [
        comment("Open MPI from the distribution (PMIx included, so `srun --mpi=pmix` works)"),
        packages(ospackages=["libopenmpi-dev", "openmpi-bin", *BUILD_PACKAGES]),
    ]


def gpu_mpi() -> list:
    """CUDA-aware Open MPI over UCX (InfiniBand verbs and GPUDirect RDMA where the host has
    them; shared memory and TCP otherwise)."""
    return [
        packages(ospackages=BUILD_PACKAGES),
        ofed(),  # the distribution's InfiniBand user-space libraries, for UCX's verbs transport
        gdrcopy(ldconfig=True, version=GDRCOPY_VERSION),
        ucx(
            cuda=True,
            gdrcopy="/usr/local/gdrcopy",
            knem=False,
            ldconfig=True,
            ofed=True,
            version=UCX_VERSION,
            xpmem=False,
        ),
        openmpi(
            cuda=True,
            infiniband=False,  # verbs go through UCX
            ldconfig=True,
            pmix="internal",
            ucx="/usr/local/ucx",
            version=OPENMPI_VERSION,
        ),
        environment(variables={"OMPI_MCA_pml": "ucx"}),  # the pml that moves GPU buffers
    ]


def python_environment(variant: str) -> list:
    """A virtual environment with TensorFlow, mpi4py built against the image's MPI, hyparflow."""
    return [
        comment("Python environment (the distribution's Python is externally managed)"),
        shell(commands=[f"python3 -m venv {VENV}"]),
        environment(variables={"PATH": f"{VENV}/bin:$PATH", "VIRTUAL_ENV": VENV}),
        pip(
            # mpi4py compiled against the image's MPI, not a binary wheel built elsewhere
            install_args=["--no-binary=mpi4py"],
            ospackages=[],
            packages=[*PYTHON_PACKAGES[variant], f"mpi4py=={MPI4PY_VERSION}"],
            pip=f"{VENV}/bin/pip",
        ),
        comment("hyparflow from this repository (build from the repository root)"),
        copy(src=["pyproject.toml", "README.md"], dest=f"{SOURCE}/"),
        copy(src="hyparflow", dest=f"{SOURCE}/hyparflow"),
        shell(commands=[f"{VENV}/bin/pip --no-cache-dir install '{SOURCE}[io]'"]),
    ]


def instructions(variant: str, base: str | None = None) -> list:
    """Every primitive and building block of the `variant` ("cpu" or "gpu") image, in order;
    `base` replaces the default base image (an apt-based one: Debian or Ubuntu)."""
    if variant not in PYTHON_PACKAGES:
        raise ValueError(f"variant must be one of {sorted(PYTHON_PACKAGES)}; got {variant!r}")
    image = base or (CPU_IMAGE if variant == "cpu" else GPU_IMAGE)
    return [
        # hpccm knows no Debian; its Ubuntu blocks are plain apt-get, which Debian runs as well
        baseimage(image=image, _distro="ubuntu24"),
        label(metadata={"org.opencontainers.image.title": f"hyparflow-{variant}"}),
        *(cpu_mpi() if variant == "cpu" else gpu_mpi()),
        *python_environment(variant),
    ]


def stage(variant: str, base: str | None = None) -> Stage:
    """The image as one hpccm Stage; `str()` of it is the recipe in hpccm's current format."""
    result = Stage()
    for instruction in instructions(variant, base):
        result += instruction
    return result


if "Stage0" in locals():  # executed by hpccm's command line, which provides Stage0 and USERARG
    import inspect
    import runpy

    # hpccm execs a recipe with separate globals and locals, so the functions above cannot see
    # this file's names: run the file again as a real module and add its instructions.
    _recipe = runpy.run_path(inspect.currentframe().f_code.co_filename)
    _args = locals().get("USERARG", {})
    for _instruction in _recipe["instructions"](_args.get("variant", "cpu"), _args.get("base")):
        locals()["Stage0"] += _instruction
