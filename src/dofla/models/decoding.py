"""The decoding cache's name in ``forward``: transformers ≥ 5.24 passes it as ``cache=``, earlier
releases as ``past_key_values=``. The student reads the name from the teacher's own signature, so
it decodes under either convention."""
from __future__ import annotations

import inspect


CACHE_KEYWORDS = ("cache", "past_key_values")  # transformers ≥ 5.24 names it ``cache``; before, ``past_key_values``


def cache_keyword(teacher_forward: inspect.Signature) -> str:
    """The name under which this transformers version passes the decoding cache to ``forward``
    (and ``generate`` keeps it in its model kwargs): read from the teacher forward's signature."""
    return next((name for name in CACHE_KEYWORDS if name in teacher_forward.parameters), "past_key_values")


def take_cache(kwargs: dict):
    """Remove the cache from ``kwargs`` under either name; both given and different is an error."""
    given = {name: kwargs.pop(name) for name in CACHE_KEYWORDS if kwargs.get(name) is not None}
    for name in CACHE_KEYWORDS:
        kwargs.pop(name, None)
    if len({id(cache) for cache in given.values()}) > 1:
        raise ValueError("both cache= and past_key_values= were passed with different caches; pass one")
    return next(iter(given.values()), None)
