"""Build of sparsekit._C, the one extension holding every sparsekit kernel.

CUDA kernels are compiled when the installed torch was built with CUDA
(``torch.version.cuda``) and nvcc is found; a GPU is never needed to build them.

Environment overrides:
  SPARSEKIT_CUDA=0        CPU-only build, even with a CUDA torch and nvcc.
  SPARSEKIT_CUDA=1        CUDA build; fails loudly when torch or nvcc cannot do it.
  TORCH_CUDA_ARCH_LIST    CUDA archs, default "8.0;9.0+PTX" (sm_80, sm_90, and PTX that newer GPUs compile on load).
  MAX_JOBS                parallel compile jobs, default from cores and free memory.
  SPARSEKIT_DEBUG=1       -O0 -g host and device code.
"""

import copy
import glob
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))


def is_cuda_toolkit(home):
    """A CUDA toolkit we can build with: nvcc, the runtime headers and the runtime library.
    (An `nvcc` on PATH may be a wrapper script outside any toolkit: linking against it
    fails only after minutes of compiling, with "cannot find -lcudart".)"""
    if not home or not os.path.exists(os.path.join(home, "bin", "nvcc")):
        return False
    if not os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        return False
    libs = ["lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"), os.path.join("targets", "sbsa-linux", "lib")]
    return any(glob.glob(os.path.join(home, lib, "libcudart.so*")) for lib in libs)


def find_cuda_home():
    """A complete CUDA toolkit, or None: $CUDA_HOME, $CUDA_PATH, nvcc on PATH, /usr/local/cuda,
    the first that has nvcc, cuda_runtime.h and libcudart."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if is_cuda_toolkit(home):
            return home
    rejected = [home for home in candidates if home and os.path.exists(os.path.join(home, "bin", "nvcc"))]
    if rejected:
        print(f"sparsekit setup: ignoring {rejected}: nvcc without the CUDA runtime headers or library "
              "(set CUDA_HOME to a complete toolkit for the CUDA kernels)", file=sys.stderr)
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
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

# The oldest torch the binary supports: its stable ABI has everything csrc/torch_api.h
# uses (torch_parallel_for, torch_call_dispatcher, the typed data pointers arrived in 2.10).
TARGET_TORCH = (2, 10)
# pyproject.toml's license string (PEP 639) needs setuptools 77.
MIN_SETUPTOOLS = (77,)


def _release(version):
    """(major, minor, ...) of a version string such as '2.13.0+cu130' or '80.9.0'."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_build_requirements():
    """Stop before compiling anything when a build requirement is missing or too old: a
    `--no-build-isolation` build uses what the environment has, and the errors those cause
    later do not name the cause."""
    from importlib import metadata

    needs = []
    try:
        import setuptools
    except ImportError:
        needs.append(f"setuptools>={MIN_SETUPTOOLS[0]} (not installed)")
    else:
        if _release(setuptools.__version__) < MIN_SETUPTOOLS:
            needs.append(f"setuptools>={MIN_SETUPTOOLS[0]} (found {setuptools.__version__})")
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    if torch_version is None:
        needs.append(f"torch>={TARGET_TORCH[0]}.{TARGET_TORCH[1]} (not installed)")
    elif _release(torch_version)[:2] < TARGET_TORCH:
        needs.append(f"torch>={TARGET_TORCH[0]}.{TARGET_TORCH[1]} (found {torch_version}): the stable ABI "
                     "sparsekit's kernels use arrived in 2.10")
    # pip's ninja sits beside this Python, off PATH unless the venv is activated.
    scripts = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        needs.append("ninja (not on PATH; without it every file compiles one at a time)")
    if needs:
        sys.exit("sparsekit's build needs " + "; ".join(needs)
                 + ". Install them first, e.g. pip install 'setuptools>=77' wheel ninja 'torch>=2.10', "
                 "or use an isolated build: pip install . (without --no-build-isolation)")


check_build_requirements()
import torch  # noqa: E402
from setuptools import setup  # noqa: E402
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


def target_version_macro():
    """TORCH_TARGET_VERSION for TARGET_TORCH, in torch/headeronly/version.h's layout."""
    major, minor = TARGET_TORCH
    return hex((major << 56) | (minor << 48))


def extension():
    debug = os.environ.get("SPARSEKIT_DEBUG") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    sources = ["csrc/sparsekit.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    # The kernels use torch's stable ABI only (csrc/torch_api.h): TORCH_TARGET_VERSION
    # hides every stable API newer than TARGET_TORCH, so the binary loads under that torch
    # and every later one. Threads come from torch's own pool (torch_parallel_for), so the
    # extension needs no OpenMP of its own.
    target = ["-DTORCH_TARGET_VERSION=" + target_version_macro()]
    # Hidden visibility: the library exports PyInit__C alone (the stable ABI's own types
    # are hidden too, and nothing of sparsekit's is for others to link against).
    cxx = opt + target + ["-fdiagnostics-color=always", "-fvisibility=hidden"]
    common = dict(
        name="sparsekit._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        py_limited_api=True,
    )
    if want_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        nvcc = opt + target + ["-lineinfo", "--expt-relaxed-constexpr", "-DSPARSEKIT_CUDA", "-Xcompiler", "-fvisibility=hidden"]
        return CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **common)
    return CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **common)


def torch_requirement():
    """The torches this build runs under: every one from TARGET_TORCH on (the stable ABI
    is kept across releases). A CUDA build also needs a torch of the same CUDA major
    version, which pip cannot express; the README says so."""
    major, minor = TARGET_TORCH
    return f"torch>={major}.{minor}"


class BuildWithInfo(BuildExtension):
    """Writes _build_info.py next to the built library: the torch and CUDA it was built
    for, so a failed import can say "built for torch X, running Y"."""

    def run(self):
        # torch's BuildExtension appends its flags to each extension's compile arguments;
        # a second run in one process (`build bdist_wheel`) would then compile every file
        # again with the flags doubled. Restoring them keeps ninja's commands unchanged.
        saved = [copy.deepcopy(ext.extra_compile_args) for ext in self.extensions]
        try:
            super().run()  # builds under build/, then copies the library into the source tree with --inplace
        finally:
            for ext, args in zip(self.extensions, saved):
                ext.extra_compile_args = args
        for ext in self.extensions:
            cuda = any(src.endswith(".cu") for src in ext.sources)
            path = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), "_build_info.py")
            with open(path, "w") as out:
                out.write("# Written by setup.py at build time; not in version control.\n")
                out.write(f"TORCH_VERSION = {torch.__version__!r}\n")
                out.write(f"CUDA_VERSION = {(torch.version.cuda if cuda else None)!r}\n")


setup(
    ext_modules=[extension()],
    install_requires=[torch_requirement(), "numpy", "xxhash", "tqdm"],
    cmdclass={"build_ext": BuildWithInfo.with_options(use_ninja=True)},
    # torch's build defines Py_LIMITED_API=0x030A0000 (CPython 3.10) for py_limited_api
    # extensions: the abi3 tag says the same.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
