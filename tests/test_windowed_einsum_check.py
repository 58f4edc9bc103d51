"""benchmarks.windowed_einsum_check on CPU (the windowed-einsum pass is GPU-only)."""

import numpy as np

import testkit
from benchmarks import windowed_einsum_check


def test_the_global_view_dot_matches_float64_by_row_block():
  result = windowed_einsum_check.check(4, 16, 128, 64)
  assert result["d"] == 4 and result["rel_err"] < 1e-2
  assert len(result["rel_err_by_row_block"]) == 4
  assert np.isclose(max(result["rel_err_by_row_block"]), result["rel_err"], rtol=0.01, atol=1e-4)


def test_the_command_runs_each_flag_set_in_its_own_process(capsys):
  with testkit.parsed_flags(windowed_einsum_check.FLAGS,
                            ["windowed_einsum_check", "--axis_sizes=2", "--shape=16x128x64"]):
    windowed_einsum_check.main()
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("D=2 ")]
  assert [row.split()[1] for row in rows] == list(windowed_einsum_check.FLAG_SETS)
  assert all("(ok)" in row for row in rows)
