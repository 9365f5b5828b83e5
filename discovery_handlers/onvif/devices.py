"""From a camera to Akri's Device, pure: the id and the properties Akri's onvif handler gives."""

from __future__ import annotations

from discovery_handlers.base import Device

SERVICE_URL = "ONVIF_DEVICE_SERVICE_URL"
UUID = "ONVIF_DEVICE_UUID"
IP_ADDRESS = "ONVIF_DEVICE_IP_ADDRESS"
MAC_ADDRESS = "ONVIF_DEVICE_MAC_ADDRESS"


def device_id(service_url: str, uuid: str) -> str:
    """Akri's device id: ``<device service url>-<uuid>`` (so the same camera at the same URL
    gets the same Instance name under Akri and under this agent)."""
    return f"{service_url}-{uuid}"


def build_device(service_url: str, uuid: str, ip: str | None, mac: str | None) -> Device:
    """The Device for one camera address; IP and MAC only when the camera reported them."""
    properties = {SERVICE_URL: service_url, UUID: uuid}
    if ip is not None:
        properties[IP_ADDRESS] = ip
    if mac is not None:
        properties[MAC_ADDRESS] = mac
    return Device(id=device_id(service_url, uuid), properties=properties)
