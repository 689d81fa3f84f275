"""A study's storage URL, checked before anything exists, and a storage error as one line.

``--storage`` takes an Optuna RDB URL (any SQLAlchemy dialect: ``sqlite:///``, ``postgresql://``, ``mysql://``)
or ``journal:PATH``. What can be known without connecting (the scheme, an installed driver, the folder of a
SQLite or journal file) is refused here in one line, before ``--out`` exists; what needs the server (a host, a
password) is refused when the storage is opened, which also happens before ``--out`` exists for a storage
outside it.
"""

from __future__ import annotations

from pathlib import Path

from crosstrain.errors import ConfigError, first_line

FORMS = "sqlite:///PATH, postgresql://..., mysql://... or journal:PATH"
#: the fix for a missing driver, by database (SQLAlchemy's default drivers: psycopg 3 and mysqlclient)
DRIVERS = {"postgresql": 'run: pip install "crosstrain[tune-postgres]" (psycopg) and write postgresql://...',
           "mysql": 'run: pip install "crosstrain[tune-mysql]" (pymysql) and write mysql+pymysql://...'}


def naming(url: str, given: bool) -> str:
    """How a message names the storage: the flag the user passed, or the study database ``--out`` holds (a
    password in the URL as ``***``)."""
    shown = shown_url(url)
    return f"--storage {shown!r}" if given else f"the study database {shown!r}"


def shown_url(url: str) -> str:
    """``url`` with its password, if any, as ``***`` (for messages and the result line)."""
    if url.startswith("journal:"):
        return url
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
    except Exception:  # not a URL at all: it has no password to hide
        return url
    return url if parsed.password is None else parsed.render_as_string(hide_password=True)


def check_url(url: str, given: bool) -> None:
    """Refuse a storage URL that cannot work, without creating or connecting to anything."""
    if url.startswith("journal:"):
        _check_file(Path(url[len("journal:"):]), url, given)
        return
    import sqlalchemy
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = sqlalchemy.engine.make_url(url)
        parsed.get_dialect().import_dbapi()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise ConfigError(f"{naming(url, given)} is not a storage URL ({message(exc)}); pass {FORMS}") from None
    except ImportError as exc:  # the dialect is known but its driver is not installed
        raise ConfigError(f"{naming(url, given)} needs a database driver that is not installed ({message(exc)}); "
                          f"{DRIVERS.get(parsed.get_backend_name(), 'install the driver its URL names')}") from None
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        _check_file(Path(parsed.database), url, given)


def _check_file(path: Path, url: str, given: bool) -> None:
    if not str(path):
        raise ConfigError(f"{naming(url, given)} names no file; pass {FORMS}")
    if path.is_dir():
        raise ConfigError(f"{naming(url, given)} is a folder; name a file in it")
    if given and not path.parent.is_dir():  # the default database's folder is --out, created by the search
        raise ConfigError(f"{naming(url, given)}: the folder {str(path.parent)!r} does not exist; create it or "
                          "pass a path in an existing folder")


def message(exc: BaseException) -> str:
    """A storage error's own first line: the driver's error for SQLAlchemy's wrapped ones, never their ``[SQL: ...]``
    or "Background on this error" lines."""
    inner = getattr(exc, "orig", None)
    return first_line(inner if isinstance(inner, BaseException) else exc)


def storage_error(exc: BaseException, url: str, given: bool) -> ConfigError:
    """The one line for a storage that could not be opened or read."""
    return ConfigError(f"{naming(url, given)} cannot be opened ({type(exc).__name__}: {message(exc)}); "
                       f"check it, or pass {FORMS}")
