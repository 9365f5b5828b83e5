"""The ``mqtt`` discovery handler: devices that announce themselves on an MQTT broker."""

from discovery_handlers.mqtt.handler import MqttHandler

__all__ = ["MqttHandler"]
