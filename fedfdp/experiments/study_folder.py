"""The study folder of ``tune``: its files checked and its database opened before anything is written.

A study lives in ``<study-dir>/`` (:data:`STUDY_FILES` beside the trials' run directories). A
folder in place of one of its files, a ``study.db`` that cannot be read (truncated, junk, another
study's) and a study started with other settings are refused in one line with nothing changed
(``tests/experiments/test_study_file_faults.py`` breaks each file every way).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedfdp.experiments.search_space import TuneError
from fedfdp.experiments.trials import Settings

__all__ = ["STUDY_FILES", "open_study"]

#: The files a study folder holds besides its trial run directories (written by :func:`_run_study`).
STUDY_FILES = ("study.db", "search_space.yaml", "best.yaml", "best.json", "trials.txt")


def _check_study_files(study_dir: Path) -> None:
    """Refuse, before anything is written, a study folder where one of its files is not a regular file."""
    if study_dir.exists() and not study_dir.is_dir():
        raise TuneError(f"--study-dir {study_dir} is a file, not a folder")
    for name in STUDY_FILES:
        path = study_dir / name
        if path.exists() and not path.is_file():
            raise TuneError(f"{path} is not a regular file (a folder?); the study keeps its {name} there: move it away")


def open_study(settings: Settings) -> tuple[Any, str]:
    """The study of ``settings`` (created when new) and its storage URL, once its folder's files are
    checked, its database read read-only and its settings found to be this study's (:func:`_check_identity`)."""
    import optuna

    _check_study_files(settings.study_dir)
    db = settings.study_dir / "study.db"
    storage = f"sqlite:///{db.resolve()}"
    try:
        if db.exists() and db.stat().st_size:  # read it before anything is written: a broken study changes nothing
            optuna.load_study(study_name=settings.study_name,
                              storage=f"sqlite:///file:{db.resolve()}?mode=ro&uri=true").trials  # noqa: B018
        settings.study_dir.mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(study_name=settings.study_name, storage=storage, direction="maximize",
                                    load_if_exists=True)
    except KeyError:  # another study's database (no study of this name): refused by the identity check below
        raise TuneError(f"{db} holds no study named {settings.study_name!r}: another study's folder? use its "
                        f"--study-dir, or another folder for this one") from None
    except Exception as err:  # noqa: BLE001 - SQLite/SQLAlchemy errors of a truncated, junk or unreadable file
        raise TuneError(f"cannot read the study {settings.study_name!r} in {db}: {' '.join(str(err).split())[:300]}; "
                        f"restore it, or move the folder away to start the study again") from err
    _check_identity(study, settings)
    return study, storage


def _check_identity(study: Any, settings: Settings) -> None:
    """Store the settings in a new study; refuse to continue a study made with other settings."""
    identity = settings.identity()
    stored = study.user_attrs.get("settings")
    if stored is None:
        study.set_user_attr("settings", identity)
        return
    stored = dict(stored)
    # the config is its content: a study copied with its checkout to another folder (or machine)
    # continues, and a config whose content changed is refused whatever its path
    if "config_sha256" in stored and stored["config_sha256"] != identity["config_sha256"]:
        raise TuneError(f"the config file {settings.config} is not the one the study in {settings.study_dir} started "
                        f"with ({stored.get('config')}, changed since); use another --study-dir for the new config")
    ignored = ("config", "config_sha256") if "config_sha256" in stored else ("config_sha256",)  # older: the path
    diff = [k for k in identity if k not in ignored and stored.get(k) != identity[k]]
    if diff:
        shown = ", ".join(f"{k} (study: {json.dumps(stored.get(k))[:80]}, now: {json.dumps(identity[k])[:80]})"
                          for k in diff)
        raise TuneError(f"the study in {settings.study_dir} was run with other settings: {shown}; resume it with "
                        f"the same options or use another --study-dir")
