"""Generated protobuf/gRPC stubs; see README.md. Do not edit by hand."""
