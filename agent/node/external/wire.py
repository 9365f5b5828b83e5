"""``v0`` messages ↔ :class:`Device` (the only module that knows both shapes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agent.node.external.endpoints import device_from_fields
from agent.protos.akri.discovery.v0 import discovery_pb2 as pb
from discovery_handlers.base import Device, DiscoveryProperties


def devices_from_response(response: pb.DiscoverResponse) -> list[Device]:
    """The devices of one ``DiscoverResponse`` (not yet checked)."""
    return [
        device_from_fields(
            d.id,
            dict(d.properties),
            [(m.container_path, m.host_path, m.read_only) for m in d.mounts],
            [(s.container_path, s.host_path, s.permissions) for s in d.device_specs],
        )
        for d in response.devices
    ]


def response_from_devices(devices: Sequence[Device]) -> pb.DiscoverResponse:
    """A ``DiscoverResponse`` carrying ``devices``."""
    return pb.DiscoverResponse(
        devices=[
            pb.Device(
                id=d.id,
                properties=dict(d.properties),
                mounts=[
                    pb.Mount(
                        container_path=m.container_path,
                        host_path=m.host_path,
                        read_only=m.read_only,
                    )
                    for m in d.mounts
                ],
                device_specs=[
                    pb.DeviceSpec(
                        container_path=s.container_path,
                        host_path=s.host_path,
                        permissions=s.permissions,
                    )
                    for s in d.device_specs
                ],
            )
            for d in devices
        ]
    )


def request_for(details: str, properties: DiscoveryProperties) -> pb.DiscoverRequest:
    """A ``DiscoverRequest`` (a property without a value is sent as ``ByteData{}``)."""
    return pb.DiscoverRequest(
        discovery_details=details,
        discovery_properties={
            key: pb.ByteData(vec=value) if value is not None else pb.ByteData()
            for key, value in properties.items()
        },
    )


def properties_of(request: pb.DiscoverRequest) -> dict[str, bytes | None]:
    """The resolved discoveryProperties of a ``DiscoverRequest``."""
    result: dict[str, bytes | None] = {}
    items: Mapping[str, pb.ByteData] = request.discovery_properties
    for key, data in items.items():
        result[key] = data.vec if data.HasField("vec") else None
    return result
