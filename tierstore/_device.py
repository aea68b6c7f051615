"""The compute device under the store: its memory, its copies, and the order between them.

[Note: Ordering device work] With CUDA a copy between the host and the
device tier runs on a copy stream and returns before its bytes have moved;
compute runs on the current stream. Each buffer remembers, per stream, the
last event recorded on that stream that reads or writes it (events on one
stream complete in order, so the last one covers the earlier ones: at most
one per stream, never a growing list). Before other work touches the buffer
it waits for them:
- a copy on a copy stream waits (on the GPU) for both buffers' events;
- compute given a device copy by ``get()`` waits (on the GPU) for the copy
  that filled it (:meth:`Device.ready_for_compute`);
- CPU code that reads a host buffer a device copy filled (the user after
  ``get(key, "host")``, the drive writing it home) waits on the CPU for that
  copy (:meth:`Device.ready_for_cpu`), at the point of use, never under the
  store's lock at the time of the copy;
- a buffer freed with work pending is fenced by its pool until the work is
  done, and only then carved again.
Without CUDA the device tier is CPU memory, copies are synchronous and none
of this is needed (:class:`CpuDevice`). ``tierstore.testing.SimulatedDevice``
copies on worker threads that finish late, so a missed wait shows up on the
CPU as wrong bytes in a test.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._memory import Buffer
from ._types import Tier, TierStoreError, UnsupportedError


class Device:
    """What the store asks of the device: where the device tier lives, copies between the two memory tiers,
    and the waits that order them (see [Note: Ordering device work]). This base class is synchronous CPU
    memory."""

    #: the device tier's memory is separate from the host's (a budget beyond host RAM is allowed there)
    separate_memory = False
    #: host tier buffers are pinned
    pins_host = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def copy(self, dst: Buffer, src: Buffer, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src`` into ``dst`` (one of them in the device tier), after any work pending
        on either; may return before the bytes have moved."""
        dst.data[:nbytes].copy_(src.data[:nbytes])

    def record_use(self, buf: Buffer) -> None:
        """Compute given ``buf`` by ``get()`` is done with it as far as the caller is concerned (``release()``):
        work queued so far must finish before the buffer is written or reused."""

    def ready_for_compute(self, buf: Buffer) -> None:
        """Make the compute that follows see ``buf``'s bytes (a device copy ``get()`` returns)."""

    def pin(self, data: torch.Tensor) -> Callable[[], None]:
        """Page-lock the host memory of ``data`` in place (a host tier arena, when :attr:`pins_host`); returns
        what unlocks it (see [Note: Pinned host memory])."""
        raise UnsupportedError(f"{type(self).__name__} pins no host memory")

    def ready_for_cpu(self, buf: Buffer) -> None:
        """Block until no pending work writes ``buf`` (a host buffer the CPU or the drive reads next)."""
        buf.wait_pending()

    def close(self) -> None:
        """The store is closing: stop anything of the device's own (worker threads of a simulated one)."""


class CpuDevice(Device):
    """No accelerator: the device tier is CPU memory and copies are done when they return."""


class CudaDevice(Device):
    """A CUDA device: copies on two streams (host to device, device to host), ordered by events."""

    separate_memory = True

    def __init__(self, *, pin_host: bool) -> None:
        super().__init__()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.pins_host = pin_host
        self._h2d = torch.cuda.Stream(self.device)
        self._d2h = torch.cuda.Stream(self.device)

    def copy(self, dst: Buffer, src: Buffer, nbytes: int) -> None:
        stream = self._h2d if dst.tier is Tier.DEVICE else self._d2h
        with torch.cuda.stream(stream):
            for ev in (*dst.pending_events(), *src.pending_events()):
                stream.wait_event(ev)
            dst.data[:nbytes].copy_(src.data[:nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        dst.add_event(stream, event)
        src.add_event(stream, event)

    def pin(self, data: torch.Tensor) -> Callable[[], None]:
        cudart, ptr, nbytes = torch.cuda.cudart(), data.data_ptr(), data.numel() * data.element_size()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise TierStoreError(
                f"could not page-lock {nbytes} bytes of host memory for the host tier (cudaHostRegister: {err}); "
                f"raise the locked-memory limit (ulimit -l), lower host_budget_bytes, or set "
                f"pin_host_memory=False")

        def unpin() -> None:
            cudart.cudaHostUnregister(ptr)

        return unpin

    def record_use(self, buf: Buffer) -> None:
        stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        buf.add_event(stream, event)

    def ready_for_compute(self, buf: Buffer) -> None:
        stream = torch.cuda.current_stream(self.device)
        for key, ev in tuple(buf.events.items()):
            if key is not stream:
                stream.wait_event(ev)


def default_device(*, pin_host: bool) -> Device:
    return CudaDevice(pin_host=pin_host) if torch.cuda.is_available() else CpuDevice()


__all__ = ["CpuDevice", "CudaDevice", "Device", "default_device"]
