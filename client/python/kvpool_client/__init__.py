"""kvpool_client: Python client of the kvpool KV-cache pool service."""

from .attend_socket import AttendSocketError
from .client import AttendItem, AttendResult, AttendStream, Client, GetResult

__all__ = ["AttendItem", "AttendResult", "AttendSocketError", "AttendStream", "Client",
           "GetResult"]
