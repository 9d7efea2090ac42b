"""Build of sparsekit._C, the one extension holding every sparsekit kernel.

CUDA kernels are compiled when the installed torch was built with CUDA
(``torch.version.cuda``) and nvcc is found; a GPU is never needed to build them.

Environment overrides:
  SPARSEKIT_CUDA=0        CPU-only build, even with a CUDA torch and nvcc.
  SPARSEKIT_CUDA=1        CUDA build; fails loudly when torch or nvcc cannot do it.
  TORCH_CUDA_ARCH_LIST    CUDA archs, default "8.0;9.0" (sm_80 and sm_90).
  MAX_JOBS                parallel compile jobs, default from cores and free memory.
  SPARSEKIT_DEBUG=1       -O0 -g host and device code.
"""

import glob
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def find_cuda_home():
    """Where nvcc lives, or None: $CUDA_HOME, $CUDA_PATH, nvcc on PATH, /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return None


def default_max_jobs():
    """One job per core, but no more than one per 3 GiB of available memory (nvcc is hungry)."""
    jobs = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    jobs = min(jobs, max(1, int(line.split()[1]) // (3 * 1024 * 1024)))
    except OSError:
        pass
    return str(jobs)


# torch.utils.cpp_extension reads CUDA_HOME when it is imported, so settle it first.
_cuda_home = find_cuda_home()
if _cuda_home:
    os.environ["CUDA_HOME"] = _cuda_home
os.environ.setdefault("MAX_JOBS", default_max_jobs())
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def want_cuda():
    """Decide the CUDA build from the toolchain, never from torch.cuda.is_available()."""
    flag = os.environ.get("SPARSEKIT_CUDA", "").strip()
    possible = torch.version.cuda is not None and _cuda_home is not None
    if flag == "0":
        return False
    if flag == "1":
        if torch.version.cuda is None:
            sys.exit("SPARSEKIT_CUDA=1 but the installed torch has no CUDA "
                     f"(torch {torch.__version__}); install a CUDA build of torch")
        if _cuda_home is None:
            sys.exit("SPARSEKIT_CUDA=1 but nvcc was not found; set CUDA_HOME to the CUDA toolkit")
        return True
    if flag:
        sys.exit(f"SPARSEKIT_CUDA must be 0 or 1, got {flag!r}")
    return possible


def extension():
    debug = os.environ.get("SPARSEKIT_DEBUG") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    sources = ["csrc/sparsekit.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    # -fopenmp: at::parallel_for is an inline template that only runs threads when the
    # extension itself is compiled with OpenMP (torch's own libgomp is then shared).
    cxx = opt + ["-fdiagnostics-color=always", "-fopenmp"]
    common = dict(
        name="sparsekit._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        py_limited_api=True,
        extra_link_args=["-fopenmp"],
    )
    if want_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        nvcc = opt + ["-lineinfo", "--expt-relaxed-constexpr", "-DSPARSEKIT_CUDA"]
        return CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **common)
    return CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **common)


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
