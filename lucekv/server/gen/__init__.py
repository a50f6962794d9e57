"""Generated from protos/lucekv/v1/lucekv.proto by `python -m lucekv.server.codegen`; do not edit."""
