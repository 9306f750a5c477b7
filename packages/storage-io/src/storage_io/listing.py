"""Every object under a location, listed through fsspec's clients, whatever the server answers."""

from __future__ import annotations

from storage_io.errors import ErrorFactory, storage_error
from storage_io.locations import open_fs
from storage_io.retries import with_retries


def list_keys(url: str, *, error: ErrorFactory = storage_error) -> list[str]:
    """The keys of every file or object below `url`, relative to it ("/"-separated), sorted; [] when none.

    A name that the server lists outside the prefix asked for is left out: it is not below `url`. Any failure of
    the client, an answer that it cannot parse included, raises `error(cause, url, "list")`.
    """
    fs, root = open_fs(url)
    root = root.rstrip("/")
    try:
        found = with_retries(lambda: fs.find(root, withdirs=False))
    except FileNotFoundError:
        return []
    except Exception as exc:  # the listing runs no code of the caller's: every failure is the storage's
        raise error(exc, url, "list") from exc
    prefix = f"{root}/" if root else ""
    return sorted(path[len(prefix) :] for path in found if path.startswith(prefix) and len(path) > len(prefix))
