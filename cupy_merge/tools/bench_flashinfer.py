"""FlashInfer's merges beside this library's, for ``python -m cupy_merge.bench --flashinfer [DIR]``.

Two sources behind one interface (:class:`FlashInferMerges`):

* ``--flashinfer`` alone: the installed ``flashinfer`` package, its ``merge_state``,
  ``merge_states`` and ``variable_length_merge_states`` as a user calls them (allocating their
  results), found by :func:`from_package`;
* ``--flashinfer DIR``: a FlashInfer source tree, whose header-only launchers
  (``DIR/include/flashinfer/attention/cascade.cuh``) :func:`from_source_tree` builds with nvcc
  through :data:`SHIM_SOURCE`, a C ABI this module writes out, and loads with ctypes; the outputs
  are allocated once, as this library's are in the benchmark.

Either way FlashInfer takes bfloat16 values in its token-major layouts and base-2 LSEs. No code of
FlashInfer is part of this package: the shim only declares what it calls.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: What to do when neither source is there, in one message.
HOW_TO_GET = (
    "FlashInfer is not available: either pip install flashinfer-python (with a torch of the same "
    "CUDA major) and pass --flashinfer, or git clone https://github.com/flashinfer-ai/flashinfer and "
    "pass --flashinfer DIR (its header-only kernels are built with nvcc; needs torch and nvcc)"
)

#: The header of FlashInfer's merge launchers, relative to a source tree.
CASCADE_HEADER = os.path.join("include", "flashinfer", "attention", "cascade.cuh")

#: The C ABI over FlashInfer's launchers (MergeState, MergeStates, VariableLengthMergeStates as
#: cascade.cuh declares them in 2025: the ragged launcher takes a device sequence length, which is
#: passed as null, and a PDL flag, passed false). bfloat16 in and out; each returns cudaError_t.
SHIM_SOURCE = r"""
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "flashinfer/attention/cascade.cuh"

using bf16 = nv_bfloat16;

extern "C" {

int cm_fi_merge_state(void* v_a, float* s_a, void* v_b, float* s_b, void* v_out, float* s_out,
                      uint32_t tokens, uint32_t heads, uint32_t head_size, void* stream) {
  return static_cast<int>(flashinfer::MergeState<bf16, bf16>(
      static_cast<bf16*>(v_a), s_a, static_cast<bf16*>(v_b), s_b, static_cast<bf16*>(v_out), s_out,
      tokens, heads, head_size, static_cast<cudaStream_t>(stream)));
}

int cm_fi_merge_states(void* v, float* s, void* v_out, float* s_out, uint32_t states,
                       uint32_t tokens, uint32_t heads, uint32_t head_size, void* stream) {
  return static_cast<int>(flashinfer::MergeStates<bf16, bf16>(
      static_cast<bf16*>(v), s, static_cast<bf16*>(v_out), s_out, states, tokens, heads, head_size,
      static_cast<cudaStream_t>(stream)));
}

int cm_fi_variable_length_merge_states(void* v, float* s, int32_t* indptr, void* v_out,
                                       float* s_out, uint32_t tokens, uint32_t heads,
                                       uint32_t head_size, void* stream) {
  return static_cast<int>(flashinfer::VariableLengthMergeStates<bf16, bf16, int32_t>(
      static_cast<bf16*>(v), s, indptr, static_cast<bf16*>(v_out), s_out, tokens, nullptr, heads,
      head_size, false, static_cast<cudaStream_t>(stream)));
}

}
"""

#: One prepared FlashInfer merge: each call launches it and returns the merged values.
Run = Callable[[], Any]


@dataclass
class FlashInferMerges:
    """FlashInfer's three merges, each prepared on its inputs (FlashInfer's layouts, base-2 LSE).

    ``two_way(v_a, s_a, v_b, s_b)``: values ``[tokens, heads, head_size]``, LSEs ``[tokens, heads]``;
    ``n_way(v, s)``: ``[tokens, states, heads, head_size]`` and ``[tokens, states, heads]``;
    ``ragged(v, s, indptr, tokens)``: rows ``[rows, heads, head_size]``, ``[rows, heads]``, int32
    offsets. Each returns a :data:`Run`. ``source`` says which FlashInfer, for the results' environment.
    """

    source: str
    two_way: Callable[..., Run]
    n_way: Callable[..., Run]
    ragged: Callable[..., Run]


def _attribute(module: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


#: Where each merge may live in the package, first found wins: the ragged merge is a Triton kernel
#: under ``flashinfer.triton.cascade`` in the releases that have it at all.
PACKAGE_NAMES = {
    "merge_state": ("merge_state", "cascade.merge_state"),
    "merge_states": ("merge_states", "cascade.merge_states"),
    "variable_length_merge_states": (
        "variable_length_merge_states",
        "cascade.variable_length_merge_states",
        "triton.cascade.variable_length_merge_states",
    ),
}


def from_package() -> FlashInferMerges | None:
    """The installed ``flashinfer`` package's merges; None (and why, on stderr) without it."""
    try:
        flashinfer = importlib.import_module("flashinfer")
    except ImportError as error:  # not installed, or installed without what it needs (torch, CUDA)
        print(f"--flashinfer: cannot import flashinfer ({error})", file=sys.stderr)
        return None
    for submodule in ("cascade", "triton.cascade"):  # a package does not import all its submodules
        try:
            importlib.import_module(f"flashinfer.{submodule}")
        except ImportError:
            pass
    found = {name: _first(flashinfer, places) for name, places in PACKAGE_NAMES.items()}
    missing = [name for name, function in found.items() if function is None]
    if missing:
        print(f"--flashinfer: the flashinfer package has no {', '.join(missing)}", file=sys.stderr)
        return None
    two, many, ragged = (found[name] for name in PACKAGE_NAMES)
    assert two is not None and many is not None and ragged is not None  # for mypy: checked just above
    version = getattr(flashinfer, "__version__", "?")
    return FlashInferMerges(
        source=f"flashinfer {version} (package)",
        two_way=lambda v_a, s_a, v_b, s_b: lambda: two(v_a, s_a, v_b, s_b)[0],
        n_way=lambda v, s: lambda: many(v, s)[0],
        ragged=lambda v, s, indptr, tokens: lambda: ragged(v, s, indptr)[0],
    )


def _first(module: Any, places: tuple[str, ...]) -> Callable[..., Any] | None:
    for place in places:
        function = _attribute(module, place)
        if callable(function):
            return function
    return None


def nvcc_command(include: str, shim: str, arch: str, output: str, nvcc: str = "nvcc") -> list[str]:
    """The command that builds the shim ``shim`` against FlashInfer's headers in ``include``."""
    return [
        nvcc, "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-shared",
        "-Xcompiler", "-fPIC", "-I", include, shim, "-o", output,
    ]  # fmt: skip


def find_nvcc() -> str | None:
    """nvcc on the PATH, else in ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin`` or ``/usr/local/cuda/bin``."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return None


def is_source_tree(directory: str) -> bool:
    """Whether ``directory`` holds FlashInfer's merge launchers where the shim includes them."""
    return os.path.isfile(os.path.join(directory, CASCADE_HEADER))


def from_source_tree(directory: str, arch: str, torch: Any) -> FlashInferMerges | None:
    """Build the shim against ``directory/include`` for ``sm_{arch}`` and load it; None (and why) if not.

    Needs nvcc and torch with CUDA (the launches run on torch's current stream). The GPU path:
    nothing here is exercised without a device and a CUDA toolkit.
    """
    if torch is None:
        print("--flashinfer DIR needs torch with CUDA: FlashInfer columns left out", file=sys.stderr)
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        print("--flashinfer DIR needs nvcc (PATH, CUDA_HOME): FlashInfer columns left out", file=sys.stderr)
        return None
    folder = tempfile.mkdtemp(prefix="cupy_merge_fi_")
    try:
        shim, library_path = os.path.join(folder, "cm_fi_shim.cu"), os.path.join(folder, "cm_fi_shim.so")
        with open(shim, "w") as f:
            f.write(SHIM_SOURCE)
        start = time.perf_counter()
        command = nvcc_command(os.path.join(directory, "include"), shim, arch, library_path, nvcc)
        built = subprocess.run(command, check=False, capture_output=True, text=True)
        if built.returncode != 0:
            print(f"building FlashInfer's kernels failed:\n{built.stderr[-2000:]}", file=sys.stderr)
            return None
        print(
            f"FlashInfer's kernels built for sm_{arch} in {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
        library = ctypes.CDLL(library_path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # a loaded library stays mapped
    return _library_merges(library, torch, f"FlashInfer headers from {os.path.abspath(directory)}")


def _library_merges(library: ctypes.CDLL, torch: Any, source: str) -> FlashInferMerges:
    """The shim's three functions, each prepared with its outputs allocated once."""
    p, u = ctypes.c_void_p, ctypes.c_uint32
    two, many, ragged = (
        library.cm_fi_merge_state,
        library.cm_fi_merge_states,
        library.cm_fi_variable_length_merge_states,
    )
    two.argtypes, many.argtypes, ragged.argtypes = (
        [p] * 6 + [u] * 3 + [p],
        [p] * 4 + [u] * 4 + [p],
        [p] * 5 + [u] * 3 + [p],
    )
    for function in (two, many, ragged):
        function.restype = ctypes.c_int

    def launcher(function: Any, arrays: tuple, sizes: tuple[int, ...], out: Any) -> Run:
        pointers = [x.data_ptr() for x in arrays]

        def run() -> Any:
            status = function(*pointers, *sizes, torch.cuda.current_stream().cuda_stream)
            if status != 0:
                raise RuntimeError(f"FlashInfer's launcher returned CUDA error {status}")
            return out

        return run

    def outputs(tokens: int, heads: int, head_size: int, like: Any) -> tuple[Any, Any]:
        v_out = torch.empty(tokens, heads, head_size, device=like.device, dtype=like.dtype)
        return v_out, torch.empty(tokens, heads, device=like.device, dtype=torch.float32)

    def two_way(v_a, s_a, v_b, s_b) -> Run:
        tokens, heads, head_size = v_a.shape
        v_out, s_out = outputs(tokens, heads, head_size, v_a)
        return launcher(two, (v_a, s_a, v_b, s_b, v_out, s_out), tuple(v_a.shape), v_out)

    def n_way(v, s) -> Run:
        tokens, states, heads, head_size = v.shape
        v_out, s_out = outputs(tokens, heads, head_size, v)
        return launcher(many, (v, s, v_out, s_out), (states, tokens, heads, head_size), v_out)

    def ragged_merge(v, s, indptr, tokens: int) -> Run:
        heads, head_size = v.shape[1:]
        v_out, s_out = outputs(tokens, heads, head_size, v)
        return launcher(ragged, (v, s, indptr, v_out, s_out), (tokens, heads, head_size), v_out)

    return FlashInferMerges(source=source, two_way=two_way, n_way=n_way, ragged=ragged_merge)
