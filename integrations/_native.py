"""The compressed update's native kernel (compressed_adamw.c beside this file): compiled once per machine with
the C compiler (``$CC``, else ``cc``), kept in a private cache directory ($XDG_CACHE_HOME/tierstore-kernels or
~/.cache/tierstore-kernels), loaded with ctypes, which lets other threads run while it does (the call releases
the GIL).

[Note: One update, two implementations] The kernel runs the arithmetic of
[Note: The compressed update's arithmetic] in one pass a block; the torch
operations in _layouts.py run the same operations one tensor-wide pass each
and give the same bits (tested on every layout, NaN and infinities too), so
a machine without a compiler trains the same numbers, only slower (measured
here: ``perf/bench_update.py``). ``TIERSTORE_NATIVE=0`` chooses the torch
operations; a compiler that fails gives one warning saying why, then the
torch operations.

The build is a few lines rather than ``torch.utils.cpp_extension.load``: that
builds a C++ Python extension (pybind11, the Python headers, ninja) where
this is one C function called through ctypes, which lets the GIL go during
the call; and its cache is keyed by the source and flags, not by the CPU that
``-march=native`` compiled for (a home directory shared by machines of two
kinds would load one's library on the other). Here the key holds the
compiler's version and the CPU's flags too, and the cache directory must be
this user's alone.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings

from tierstore import TierOSError
from tierstore.swap import user_cache_path

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compressed_adamw.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")


class UpdateArgs(ctypes.Structure):
    """compressed_adamw.c's update_args."""

    _fields_ = [
        ("n", ctypes.c_int64),
        ("moments", ctypes.c_int), ("weight", ctypes.c_int), ("grad", ctypes.c_int), ("maximize", ctypes.c_int),
        ("m", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("m_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p),
        ("map_m", ctypes.c_void_p), ("map_v", ctypes.c_void_p),
        ("table_m", ctypes.c_void_p), ("table_v", ctypes.c_void_p),
        ("w", ctypes.c_void_p), ("low", ctypes.c_void_p),
        ("seed_lo", ctypes.c_uint32), ("seed_hi", ctypes.c_uint32),
        ("g", ctypes.c_void_p),
        ("decay", ctypes.c_float), ("b1", ctypes.c_float), ("omb1", ctypes.c_float), ("b2", ctypes.c_float),
        ("omb2", ctypes.c_float), ("bc2_sqrt", ctypes.c_float), ("eps", ctypes.c_float),
        ("step_size", ctypes.c_float),
    ]


def matches(lib: ctypes.CDLL) -> bool:
    """Whether the library's update_args is :class:`UpdateArgs`: the same size, the same fields in the same
    order, each at the same offset."""
    lib.tierstore_compressed_adamw_args_size.restype = ctypes.c_int64
    lib.tierstore_compressed_adamw_args_names.restype = ctypes.c_char_p
    lib.tierstore_compressed_adamw_args_offsets.restype = ctypes.c_int64
    lib.tierstore_compressed_adamw_args_offsets.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    names = [name for name, _ in UpdateArgs._fields_]
    offsets = (ctypes.c_int64 * len(names))()
    count = lib.tierstore_compressed_adamw_args_offsets(offsets, len(names))
    theirs = lib.tierstore_compressed_adamw_args_names().decode().rstrip(",").split(",")
    return (lib.tierstore_compressed_adamw_args_size() == ctypes.sizeof(UpdateArgs) and theirs == names
            and count == len(names) and list(offsets) == [getattr(UpdateArgs, name).offset for name in names])


_lock = threading.Lock()
_loaded: list = []  # [the kernel function or None], once tried
_why: list = []  # [why it could not be built], until said


def cache_dir() -> str:
    return user_cache_path("tierstore-kernels")


def _machine_key(compiler: str) -> str:
    """What the compiled library depends on: the source, the flags, the compiler and the CPU (-march=native)."""
    h = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        h.update(f.read())
    h.update(" ".join(FLAGS).encode())
    version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30)
    h.update(version.stdout)
    h.update(platform.machine().encode())
    try:
        with open("/proc/cpuinfo", "rb") as f:
            h.update(next((line for line in f if line.startswith(b"flags")), b""))
    except OSError:
        pass
    return h.hexdigest()[:24]


def _private_dir(path: str) -> None:
    """Make ``path`` a directory only this user can write, or refuse one that others could change (a library
    loaded from it runs as this process)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise TierOSError(f"{path} belongs to another user or others can write to it: a compiled kernel is not "
                          f"loaded from there; make it yours with mode 0700, or set XDG_CACHE_HOME")


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise TierOSError(f"no C compiler {compiler!r} on PATH (set CC, or install one, e.g. gcc)")
    directory = cache_dir()
    _private_dir(directory)
    path = os.path.join(directory, f"compressed_adamw-{_machine_key(compiler)}.so")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *FLAGS, "-o", tmp, SOURCE, "-lm"], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode != 0:
                raise TierOSError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
            os.chmod(tmp, 0o700)
            os.replace(tmp, path)  # another process's build of the same source is the same library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(path)
    if not matches(lib):
        raise TierOSError(f"{path} does not match this tierstore (its arguments differ): remove it to rebuild")
    fn = lib.tierstore_compressed_adamw
    fn.argtypes = [ctypes.POINTER(UpdateArgs), ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    fn.library = lib  # kept alive with the function
    return fn


def kernel(*, warn: bool = True):
    """The compiled update (``fn(byref(args), start, stop)``, its library as ``fn.library``), or None: torch
    operations run it instead. Built once; where it cannot be, the first call with ``warn`` says why (a caller that
    only speeds something up with it passes ``warn=False``)."""
    if not _loaded:
        with _lock:
            if not _loaded:
                fn = None
                if os.environ.get("TIERSTORE_NATIVE", "1") != "0":
                    try:
                        fn = _build()
                    except (OSError, subprocess.SubprocessError) as e:
                        _why[:] = [str(e)]
                _loaded.append(fn)
    if warn and _why:
        with _lock:
            why = _why.pop() if _why else None
        if why is not None:
            warnings.warn(f"tierstore's compressed optimizer update runs as torch operations (the same numbers, "
                          f"20-30 times slower where measured; install a C compiler, or set $CC, for the kernel): "
                          f"its native kernel could not be built: {why}", RuntimeWarning, stacklevel=3)
    return _loaded[0]


def function(name: str, argtypes: list, restype: object):
    """Another function of the kernel's library (None where it is not built: see :func:`kernel`)."""
    fn = kernel(warn=False)
    f = getattr(fn.library, name, None) if fn is not None else None
    if f is not None:
        f.argtypes, f.restype = argtypes, restype
    return f
