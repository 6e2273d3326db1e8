"""The tenant admin dashboard, served by the API server at /admin (server-rendered HTML, small scripts
from the same origin, no network fetch at run time).

    from loraplex.admin_ui import mount_admin
    mount_admin(app)          # create_app does this

Files: mount.py (routes, static files, error pages), sessions.py (server-side sessions), guard.py
(sign-in, roles, CSRF, cookies), render.py (templates, filters, security headers), api_calls.py (the
API's route functions run as the signed-in principal), pages_*.py (one page family each), filters.py,
usage_view.py and latency_view.py (report rows -> tables and chart series), templates/ and static/.
README.md has the rules.
"""

from .mount import mount_admin
from .pages_adapters import UPLOAD_PATH

__all__ = ["UPLOAD_PATH", "mount_admin"]
