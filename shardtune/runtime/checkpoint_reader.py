"""Reading a torch.distributed.checkpoint folder without running code from it (in runtime/: the strategies of
parallel/ and the export command both read checkpoints with it).

torch's FileSystemReader reads a checkpoint's ``.metadata`` with plain ``pickle.load``: a planted pickle runs
whatever it names as soon as the checkpoint is loaded (resumed or exported). The tensors themselves are read with
``torch.load(weights_only=True)`` already. SafeFileSystemReader unpickles the metadata with a whitelist of the
record classes torch writes there, and refuses anything else in one line.
"""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader


class UnsafeCheckpointError(ValueError):
    """A checkpoint's metadata names something other than torch.distributed.checkpoint's own record classes."""


_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"its .metadata names {module}.{name}, which is not a record of "
            "torch.distributed.checkpoint: not loaded (a pickle that names other code runs it)"
        )


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader, whose read_metadata unpickles only torch.distributed.checkpoint's own records (the
    tensors themselves are read with torch.load(weights_only=True) by torch already)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
