"""`python -m harness.gpu_check`: see harness.gpu_check."""

from __future__ import annotations

from harness.gpu_check.runner import main

raise SystemExit(main())
