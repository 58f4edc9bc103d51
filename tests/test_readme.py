"""The README's examples run on CPU and print what the README says they print."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks(lang: str) -> list[str]:
  """The README's fenced code blocks of language `lang` ("" for plain ones)."""
  blocks, current, current_lang = [], None, None
  for line in README.read_text().splitlines():
    if line.startswith("```") and current is None:
      current, current_lang = [], line[3:].strip()
    elif line.startswith("```"):
      if current_lang == lang:
        blocks.append("\n".join(current) + "\n")
      current = None
    elif current is not None:
      current.append(line)
  return blocks


def _run(code: str) -> str:
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(README.parent)}
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        timeout=240, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def test_the_readme_has_its_two_examples():
  assert len(_blocks("python")) == 2


@pytest.mark.timeout(300)
def test_ops_example_prints_its_documented_output():
  expected = next(b for b in _blocks("") if "all_gather_matmul == x @ w" in b)
  assert _run(_blocks("python")[0]).splitlines() == expected.splitlines()


@pytest.mark.timeout(300)
def test_model_example_ends_as_documented():
  ending = re.search(r"Output ends with `(.*?)`", README.read_text(), flags=re.S).group(1)
  last = _run(_blocks("python")[1]).splitlines()[-1]
  assert last == ending
