import subprocess
import sys


def test_import_multigpu_does_not_import_torch() -> None:
    code = "import multigpu, multigpu.cli.main, multigpu.rank.bootstrap, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "False", out.stderr
