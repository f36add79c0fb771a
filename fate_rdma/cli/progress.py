"""A progress bar for long transfers in the CLI (tqdm); library use shows none unless asked."""
from __future__ import annotations

import sys
from typing import Any, Optional


def attach(fut: Any, label: str, enabled: Optional[bool] = None) -> Any:
    """Show `fut`'s progress on stderr (default: only when stderr is a terminal). Returns the bar or None."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled or fut.total_bytes < (64 << 20):
        return None
    from tqdm import tqdm

    bar = tqdm(total=fut.total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=label, leave=False)
    last = [0]

    def on_progress(done: int, total: int) -> None:
        bar.update(done - last[0])
        last[0] = done

    fut.add_progress_callback(on_progress)
    fut.add_done_callback(lambda _f: bar.close())
    return bar
