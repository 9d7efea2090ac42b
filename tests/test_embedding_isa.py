"""The CPU pooling loops exist in three instantiations (AVX-512, AVX2, baseline x86-64),
and the kernel takes the widest the CPU has. SPARSEKIT_CPU_CAPABILITY lowers that choice
(read once per process), so the embedding tests run here again, in child processes, under
each lower one: on an AVX-512 machine every instantiation is then checked against the
plain-torch references."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_embedding_tests_pass_under_a_lower_cpu_capability(capability):
    env = dict(os.environ, SPARSEKIT_CPU_CAPABILITY=capability, SPARSEKIT_TEST_DEVICES="cpu")
    tests = [os.path.join("tests", name) for name in ("test_embedding.py", "test_embedding_properties.py")]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
