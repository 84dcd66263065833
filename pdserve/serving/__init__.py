"""Pieces shared by the serving processes: proto conversion, registration, gRPC helpers."""
