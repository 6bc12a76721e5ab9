"""gRPC stubs generated from proto/farm/v1 by `make proto`; do not edit."""
