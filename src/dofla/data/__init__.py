from dofla.data import hub  # noqa: F401  (registers the hub sources)
from dofla.data.sources import DATA_SOURCES, DataError, DataSource, build_source
from dofla.data.tokens import pack_tokens

__all__ = ["DATA_SOURCES", "DataError", "DataSource", "build_source", "pack_tokens"]
