"""kvpool_client: Python client of the kvpool KV-cache pool service."""

from .client import AttendItem, AttendResult, AttendStream, Client, GetResult

__all__ = ["AttendItem", "AttendResult", "AttendStream", "Client", "GetResult"]
