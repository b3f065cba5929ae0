"""The .proto contracts and their generated Python stubs (`make protos`)."""
