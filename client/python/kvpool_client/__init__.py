"""kvpool_client: Python client of the kvpool KV-cache pool service."""

from .attend_socket import AttendSocketError, RegionStepLayout
from .client import (AttendItem, AttendResult, AttendStream, Client, GetResult,
                     InPlaceAttendStream)
from .sharding import rendezvous_shard, shard_for

__all__ = ["AttendItem", "AttendResult", "AttendSocketError", "AttendStream", "Client",
           "GetResult", "InPlaceAttendStream", "RegionStepLayout", "rendezvous_shard", "shard_for"]
