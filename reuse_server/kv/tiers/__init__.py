"""KV tiers below the device pool: host RAM (host.py), local disk that survives restarts (disk.py) and Redis
shared by several servers (remote.py), behind one face for the engine (manager.KVTiers). Blocks are named
by their chain hash (radix.hashing) and stored as self-describing blobs (blob.py)."""
from reuse_server.kv.tiers.blob import BadBlob, BlobContext, BlockEntry
from reuse_server.kv.tiers.disk import DiskTier
from reuse_server.kv.tiers.host import HostTier
from reuse_server.kv.tiers.manager import WRITE_POLICIES, KVTiers
from reuse_server.kv.tiers.remote import RedisTier

__all__ = ["BadBlob", "BlobContext", "BlockEntry", "DiskTier", "HostTier", "KVTiers", "RedisTier", "WRITE_POLICIES"]
