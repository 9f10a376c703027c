"""The deploy/ NATS configuration as tests log in to it: the rendered configs, every user's password, a login."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from bus import nats_config as natsconf
from bus.subjects import Subjects
from engine.model_files import DEFAULT_MODEL

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load_render() -> ModuleType:
    """deploy/render_nats_conf.py as a module (deploy/ is not a package)."""
    spec = importlib.util.spec_from_file_location("render_nats_conf", DEPLOY / "render_nats_conf.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


#: deploy/render_nats_conf.py: the committed configs (SINGLE_OUT, CLUSTER_OUT, ...) and how they are made
render = load_render()


def password_env() -> dict[str, str]:
    """A password for every user of the rendered configs, as nats-server reads them."""
    env = {u.password_var: f"pw-{u.name}" for u in natsconf.deploy_users(Subjects(DEFAULT_MODEL))}
    env["TANDEM_NATS_PASSWORD_SYS"] = "pw-sys"
    return env


def login_env(user: str) -> dict[str, str]:
    """What a tandem process logging in as deploy ``user`` gets (its password as in password_env, its inbox)."""
    return {"TANDEM_NATS_USER": user, "TANDEM_NATS_PASSWORD": f"pw-{user}",
            "TANDEM_NATS_INBOX_PREFIX": natsconf.inbox_of(user)}
