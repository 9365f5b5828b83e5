"""``Register`` calls to kubelet's device-plugin registration service, over one channel.

Every plugin of the node registers on ``kubelet.sock``; after a kubelet restart all of them do
so at once. One gRPC channel (HTTP/2 multiplexes the calls) saves a connection per plugin.
The channel is replaced after a kubelet restart (its connection is the dead kubelet's) and
after a call that could not reach kubelet, so a retry dials afresh instead of waiting out
gRPC's own reconnect backoff. A replaced channel is closed only once no call uses it: closing
a channel cancels its calls, which would silently end other plugins' registrations.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from agent.ops.streaks import FailureStreak
from agent.protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger("agent.node.deviceplugin.endpoint")  # where registrations are logged

KUBELET_SOCKET = "kubelet.sock"
# codes that say the connection (not kubelet's answer) failed: dial afresh next time
_CONNECTION_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class KubeletRegistrar:
    """Sends ``RegisterRequest``s to ``<directory>/kubelet.sock``."""

    def __init__(self, directory: Path) -> None:
        self._target = f"unix://{directory / KUBELET_SOCKET}"
        self._channel: grpc.aio.Channel | None = None
        self._calls: dict[grpc.aio.Channel, int] = {}  # calls in flight per channel
        self._closing: set[asyncio.Task[None]] = set()
        # every plugin's failed registrations (kubelet not there yet, ...): one warning when
        # they start, one line when they end (issue 36)
        self.failures = FailureStreak(
            log,
            "registering device plugins with kubelet",
            'akri_kubelet_registration_failures_total{plugin="device_plugin"}',
            noun="resource",
        )

    @property
    def channel(self) -> grpc.aio.Channel | None:
        """The channel the next call uses (None: it dials a new one)."""
        return self._channel

    async def register(self, request: api_pb2.RegisterRequest, *, rpc_timeout: float) -> None:
        """One ``Register`` call; raises the call's error."""
        channel = self._channel
        if channel is None:
            channel = self._channel = grpc.aio.insecure_channel(self._target)
        self._calls[channel] = self._calls.get(channel, 0) + 1
        try:
            await api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=rpc_timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() in _CONNECTION_CODES:
                self._retire(channel)
            raise
        finally:
            if channel in self._calls:  # not already closed by close()
                self._calls[channel] -= 1
                self._close_if_idle(channel)

    def reset(self) -> None:
        """kubelet restarted: the next call dials the new ``kubelet.sock``."""
        if self._channel is not None:
            self._retire(self._channel)

    async def close(self) -> None:
        self.reset()
        for channel in list(self._calls):
            self._close(channel)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _retire(self, channel: grpc.aio.Channel) -> None:
        if self._channel is channel:
            self._channel = None
        self._close_if_idle(channel)

    def _close_if_idle(self, channel: grpc.aio.Channel) -> None:
        if channel is not self._channel and self._calls.get(channel, 0) == 0:
            self._close(channel)

    def _close(self, channel: grpc.aio.Channel) -> None:
        self._calls.pop(channel, None)
        task = asyncio.create_task(channel.close(None), name="kubelet-registration-close")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
