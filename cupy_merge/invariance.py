"""Batch-invariant merges: a token's result is the same bits whatever else is in the batch.

A merge combines each row's states (a row: one token's head) in some association order, and
float32 sums of the same terms in another order differ in their last bits. By default the
planner picks that order for speed from the whole batch (how many groups of threads split a
row's states follows how many rows there are), so a token merged alone and the same token
merged among thousands may differ by an ulp. In batch-invariant mode the order of a row
depends on the row alone: an N-way row of ``n`` states is folded by ``min(64, ceil(n / 16))``
groups of threads (fewer for FP8 group scales: a block holds whole groups) whose partials meet
in one fixed tree, whichever kernel, block shape or batch size the planner chooses; a ragged
row by one; a gradient's sums over a row's packs and states follow the row's shape and the
arrays' layout alone. Two-way merges are batch-invariant in either
mode (each element is its own). The sinks' gradients are sums over the batch: the same bits on
every run in either mode (fixed order, no atomics), but not batch-invariant by nature.

The mode is process-wide (:func:`set_batch_invariant`, or ``CUPY_MERGE_BATCH_INVARIANT=1`` in
the environment before import) or per thread (:func:`batch_invariant`, a context manager).
Calls plan when first seen and keep their plan: ``bind`` and ``jax.jit`` take the mode in force
when they bind or trace; compiled torch graphs run their merges in the mode in force when they
run. Autograd's thread sees the process-wide mode only: an eager merge's backward runs in its
forward's mode, but with ``torch.compile``, activation checkpointing or compiled autograd use
the process-wide switch.

Its guarantees and measured cost: ``docs/determinism.rst`` (``python -m cupy_merge.bench --invariant``).

>>> import cupy_merge as cm
>>> with cm.batch_invariant():                    # doctest: +SKIP
...     out, lse = cm.merge_states(v, s)          # the same bits for a token at any batch size
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import _dispatch, _tuning

__all__ = ["batch_invariant", "is_batch_invariant", "set_batch_invariant"]


def set_batch_invariant(enabled: bool = True) -> None:
    """Turn batch-invariant planning on (or off) for every thread of the process.

    Merges bound (``cm.bind``) or traced (``jax.jit``) before keep the plans they were given.

    Parameters
    ----------
    enabled : bool
        True: a token's results are the same bits whatever else is in the batch; False: the
        default, plans chosen for speed from the whole batch.

    Examples
    --------
    >>> import cupy_merge as cm
    >>> cm.set_batch_invariant(True)      # once at start-up, as an engine's deterministic mode would
    >>> cm.is_batch_invariant()
    True
    >>> cm.set_batch_invariant(False)
    """
    _dispatch.set_default_tuning(_tuning.DEFAULT.replace(batch_invariant=_flag(enabled)))


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Plan the merges of this thread (and asyncio task) batch-invariantly inside the block.

    Parameters
    ----------
    enabled : bool
        True: batch-invariant plans inside the block; False: the default plans inside it, whatever
        the process-wide mode.

    Yields
    ------
    None
        The mode is restored when the block ends.

    Examples
    --------
    >>> import cupy_merge as cm
    >>> with cm.batch_invariant():
    ...     cm.is_batch_invariant()
    True
    >>> cm.is_batch_invariant()
    False
    """
    with _tuning.use(_tuning.current().replace(batch_invariant=_flag(enabled))):
        yield


def is_batch_invariant() -> bool:
    """Whether merges called here and now are planned batch-invariantly.

    Returns
    -------
    bool
        The mode in force on this thread: :func:`batch_invariant`'s inside its block, else the
        process-wide one (:func:`set_batch_invariant`, ``CUPY_MERGE_BATCH_INVARIANT``).

    Examples
    --------
    >>> import cupy_merge as cm
    >>> cm.is_batch_invariant()
    False
    """
    return _tuning.current().batch_invariant


def _flag(enabled: object) -> bool:
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected True or False, got {enabled!r}")
    return enabled
