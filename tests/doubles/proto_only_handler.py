"""A discovery handler written only from ``protos/akri/discovery/v0/discovery.proto``.

It imports nothing of the agent: its stubs are generated from the .proto with grpc_tools into
``--stubs`` at start, so that a test with it proves wire compatibility with Akri's protocol,
not agreement between two halves of our own code. It registers with the agent's
``agent-registration.sock`` and streams device lists; ``--mode`` makes it misbehave:

- ``normal``: the list, then the same list again every second (Akri's handlers re-send);
- ``duplicate``: a list with one id twice;
- ``flood``: lists as fast as it can;
- ``silent``: accepts Discover and never sends anything;
- ``huge``: one device with a 5 MiB property;
- ``garbage``: the list, then bytes that are no ``DiscoverResponse`` (a length-delimited
  field whose length runs past the end of the message), then goes on sending lists.

Prints ``REGISTERED`` after the agent accepted the registration, or ``REFUSED <code>`` and
exits 3 when it did not.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
PROTO = "akri/discovery/v0/discovery.proto"


def load_stubs(directory: Path) -> tuple[Any, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "akri" / "discovery" / "v0" / "discovery_pb2_grpc.py").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"--python_out={directory}",
                f"--grpc_python_out={directory}",
                str(PROTO_ROOT / PROTO),
            ],
            check=True,
        )
    sys.path.insert(0, str(directory))
    pb = importlib.import_module("akri.discovery.v0.discovery_pb2")
    pb_grpc = importlib.import_module("akri.discovery.v0.discovery_pb2_grpc")
    return pb, pb_grpc


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stubs", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True, help="the agent's handler directory")
    parser.add_argument("--name", required=True)
    parser.add_argument("--socket", type=Path, required=True, help="where to serve Discover")
    parser.add_argument(
        "--register-as", default=None, help="endpoint to register (default: --socket)"
    )
    parser.add_argument("--devices", default="", help="comma-separated ids")
    parser.add_argument("--mode", default="normal")
    parser.add_argument("--shared", action="store_true")
    args = parser.parse_args()

    import grpc

    pb, pb_grpc = load_stubs(args.stubs)
    ids = [i for i in args.devices.split(",") if i]

    def response(device_ids: list[str], extra: dict[str, str] | None = None) -> Any:
        return pb.DiscoverResponse(
            devices=[
                pb.Device(id=i, properties={"PROTO_ONLY_ID": i, **(extra or {})})
                for i in device_ids
            ]
        )

    class Handler(pb_grpc.DiscoveryHandlerServicer):  # type: ignore[misc]
        async def Discover(self, request: Any, context: Any) -> Any:
            print(f"DISCOVER {request.discovery_details!r}", flush=True)
            if args.mode == "silent":
                await asyncio.Event().wait()
            if args.mode == "duplicate":
                yield response(ids + ids[:1])
                await asyncio.Event().wait()
            if args.mode == "huge":
                yield response(ids, {"BIG": "x" * (5 * 1024 * 1024)})
                await asyncio.Event().wait()
            if args.mode == "flood":
                while True:
                    yield response(ids)
            while True:
                yield response(ids)
                await asyncio.sleep(1)

    registration = args.dir / "agent-registration.sock"
    for _ in range(600):  # like Akri's handlers: wait for the agent (here up to 30 s)
        if registration.exists():
            break
        await asyncio.sleep(0.05)
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 16 * 1024 * 1024)])
    if args.mode == "garbage":
        # the same method, answered with raw bytes that no protobuf parser accepts
        async def garbage(request: bytes, context: Any) -> Any:
            print("DISCOVER (garbage)", flush=True)
            yield response(ids).SerializeToString()
            yield b"\x0a\x7f\x0a"  # field 1 (devices), 127 bytes announced, 1 present
            while True:
                await asyncio.sleep(1)
                yield response(ids).SerializeToString()

        method = grpc.unary_stream_rpc_method_handler(
            garbage, request_deserializer=None, response_serializer=None
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v0.DiscoveryHandler", {"Discover": method}),)
        )
    else:
        pb_grpc.add_DiscoveryHandlerServicer_to_server(Handler(), server)
    server.add_insecure_port(f"unix://{args.socket}")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{registration}") as ch:
        stub = pb_grpc.RegistrationStub(ch)
        request = pb.RegisterDiscoveryHandlerRequest(
            name=args.name,
            endpoint=args.register_as or str(args.socket),
            endpoint_type=pb.RegisterDiscoveryHandlerRequest.EndpointType.UDS,
            shared=args.shared,
        )
        try:
            await stub.RegisterDiscoveryHandler(request, timeout=10)
        except grpc.aio.AioRpcError as error:
            print(f"REFUSED {error.code().name} {error.details()}", flush=True)
            return 3
    print("REGISTERED", flush=True)
    await server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
