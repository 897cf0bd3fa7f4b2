"""ruff (lint and format), as configured in pyproject.toml, is part of the test command."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('args', [['check', '.'], ['format', '--check', '.']])
def test_ruff_is_clean(args):
    proc = subprocess.run([sys.executable, '-m', 'ruff', *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
