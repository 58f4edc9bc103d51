"""Honest shard_map types for kernel outputs.

A Mosaic GPU kernel's outputs are typed from its `out_type`, which carries no
varying-manual-axes (vma) information: inside `shard_map` they come out typed
as replicated even when every device holds different values. Autodiff then
treats them as replicated and sums their cotangents over the axis, a silently
wrong gradient. `mark_varying` restores the type.
"""

import jax
from jax import lax


def varying_axes(*operands, axis_name=None) -> frozenset[str]:
  """The manual axes any operand varies over, plus `axis_name` (if bound).

  The output of a kernel that reads these operands, and exchanges data over
  `axis_name`, may differ along each of them.
  """
  axes = set().union(*(jax.typeof(x).manual_axis_type.varying for x in operands))
  if axis_name is not None:
    axes |= {axis_name} if isinstance(axis_name, str) else set(axis_name)
  return frozenset(axes)


def mark_varying(outputs, axes: frozenset[str]):
  """Each array of the pytree `outputs`, typed as varying over `axes`."""
  def cast(x):
    if missing := tuple(sorted(axes - jax.typeof(x).manual_axis_type.varying)):
      return lax.pcast(x, missing, to="varying")
    return x
  return jax.tree.map(cast, outputs)


def sum_to_varying_of(ct, primal):
  """A cotangent `ct`, summed over the manual axes it varies over and
  `primal` does not.

  A kernel's cotangent varies over every axis its inputs vary over (the
  outputs are typed so); where the primal is replicated (a weight over a data
  axis), its gradient is the sum of its replicas' contributions.
  """
  have = jax.typeof(ct).manual_axis_type.varying
  want = jax.typeof(primal).manual_axis_type.varying
  if extra := tuple(sorted(have - want)):
    ct = lax.psum(ct, extra)
  return ct
