from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterDiscoveryHandlerRequest(_message.Message):
    __slots__ = ("name", "endpoint", "endpoint_type", "shared")
    class EndpointType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UDS: _ClassVar[RegisterDiscoveryHandlerRequest.EndpointType]
        NETWORK: _ClassVar[RegisterDiscoveryHandlerRequest.EndpointType]
    UDS: RegisterDiscoveryHandlerRequest.EndpointType
    NETWORK: RegisterDiscoveryHandlerRequest.EndpointType
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    name: str
    endpoint: str
    endpoint_type: RegisterDiscoveryHandlerRequest.EndpointType
    shared: bool
    def __init__(self, name: _Optional[str] = ..., endpoint: _Optional[str] = ..., endpoint_type: _Optional[_Union[RegisterDiscoveryHandlerRequest.EndpointType, str]] = ..., shared: _Optional[bool] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ByteData(_message.Message):
    __slots__ = ("vec",)
    VEC_FIELD_NUMBER: _ClassVar[int]
    vec: bytes
    def __init__(self, vec: _Optional[bytes] = ...) -> None: ...

class DiscoverRequest(_message.Message):
    __slots__ = ("discovery_details", "discovery_properties")
    class DiscoveryPropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ByteData
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ByteData, _Mapping]] = ...) -> None: ...
    DISCOVERY_DETAILS_FIELD_NUMBER: _ClassVar[int]
    DISCOVERY_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    discovery_details: str
    discovery_properties: _containers.MessageMap[str, ByteData]
    def __init__(self, discovery_details: _Optional[str] = ..., discovery_properties: _Optional[_Mapping[str, ByteData]] = ...) -> None: ...

class DiscoverResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("id", "properties", "mounts", "device_specs")
    class PropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SPECS_FIELD_NUMBER: _ClassVar[int]
    id: str
    properties: _containers.ScalarMap[str, str]
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    device_specs: _containers.RepeatedCompositeFieldContainer[DeviceSpec]
    def __init__(self, id: _Optional[str] = ..., properties: _Optional[_Mapping[str, str]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., device_specs: _Optional[_Iterable[_Union[DeviceSpec, _Mapping]]] = ...) -> None: ...

class Mount(_message.Message):
    __slots__ = ("container_path", "host_path", "read_only")
    CONTAINER_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    container_path: str
    host_path: str
    read_only: bool
    def __init__(self, container_path: _Optional[str] = ..., host_path: _Optional[str] = ..., read_only: _Optional[bool] = ...) -> None: ...

class DeviceSpec(_message.Message):
    __slots__ = ("container_path", "host_path", "permissions")
    CONTAINER_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    container_path: str
    host_path: str
    permissions: str
    def __init__(self, container_path: _Optional[str] = ..., host_path: _Optional[str] = ..., permissions: _Optional[str] = ...) -> None: ...
