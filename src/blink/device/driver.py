"""CUDA driver and runtime calls through cuda-python, with errors raised by name (``LaunchError``)."""
from __future__ import annotations

from blink.errors import LaunchError


def check(result):
    """Unwrap a cuda.bindings result tuple, raising ``LaunchError`` with the error's name."""
    from cuda.bindings import driver, runtime

    code = result[0]
    if int(code) != 0:
        if isinstance(code, runtime.cudaError_t):
            name = runtime.cudaGetErrorName(code)[1].decode()
        else:
            name = driver.cuGetErrorName(code)[1].decode()
        raise LaunchError(f"CUDA call failed: {name}")
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)


def error_name(code: int) -> str:
    """The runtime's name of a ``cudaError_t`` code (as the device loop stores it in ``launch_error``)."""
    from cuda.bindings import runtime

    try:
        return runtime.cudaGetErrorName(runtime.cudaError_t(code))[1].decode()
    except ValueError:
        return f"cudaError {code}"
