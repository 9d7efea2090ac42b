"""Compile csrc source files to objects in a temp dir, with the extension's flags.

For checking kernel files quickly (e.g. a .cu file on a machine with nvcc but no GPU)
without rebuilding the whole extension; like setup.py it compiles against torch's stable
ABI only, pinned to torch 2.10 (TORCH_TARGET_VERSION):

    CUDA_HOME=/usr/local/cuda python scripts/compile_one.py csrc/cuda/unique_cuda.cu [more files]
"""

import os
import subprocess
import sys
import sysconfig
import tempfile

os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")

from torch.utils import cpp_extension  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(path: str) -> int:
    is_cuda = path.endswith(".cu")
    includes = cpp_extension.include_paths("cuda" if is_cuda else "cpu")
    includes += [os.path.join(ROOT, "csrc"), sysconfig.get_paths()["include"]]
    defines = ["-DTORCH_EXTENSION_NAME=_C", "-D_GLIBCXX_USE_CXX11_ABI=1", "-DPy_LIMITED_API=0x030A0000",
               "-DTORCH_TARGET_VERSION=0x20a000000000000"]
    out = os.path.join(tempfile.mkdtemp(), os.path.basename(path) + ".o")
    inc = [f"-I{p}" for p in includes]
    if is_cuda:
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0").split(";")
        gencode = []
        for arch in archs:
            num = arch.replace(".", "")
            gencode += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
        cmd = [os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"), "-c", path, "-o", out,
               "-std=c++20", "-O3", "--expt-relaxed-constexpr", "-lineinfo", "-DSPARSEKIT_CUDA",
               "--compiler-options", "-fPIC,-fvisibility=hidden", "-D__CUDA_NO_HALF_OPERATORS__",
               "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
               "-D__CUDA_NO_HALF2_OPERATORS__"] + gencode + inc + defines
    else:
        cmd = ["c++", "-c", path, "-o", out, "-std=c++20", "-O3", "-fPIC", "-fvisibility=hidden", "-Wall"] + inc + defines
    print(" ".join(cmd[:4]), "...", flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(max(main(p) for p in sys.argv[1:]))
