"""Jinja filters: numbers with their units, times as <time> elements (local in the browser, UTC on hover)."""

from __future__ import annotations

from datetime import UTC, datetime

from markupsafe import Markup, escape


def fmt_time(at: datetime | None, style: str = "datetime") -> Markup:
    """A <time> element: UTC text that the console's script turns into local time; UTC on hover."""
    if at is None:
        return Markup("—")
    utc = at.astimezone(UTC)
    text = (
        utc.strftime("%Y-%m-%d %H:%M:%S UTC") if style == "datetime" else utc.strftime("%H:%M UTC")
    )
    return Markup(
        '<time datetime="{iso}" title="{title}" data-style="{style}">{text}</time>'
    ).format(
        iso=utc.isoformat(), title=utc.strftime("%Y-%m-%d %H:%M:%S UTC"), style=style, text=text
    )


def fmt_duration_s(seconds: float | None) -> str:
    """A duration such as `42 s`, `5.0 min`, `3.2 h` or `2.1 d`."""
    if seconds is None:
        return "—"
    sign = "-" if seconds < 0 else ""
    s = abs(seconds)
    if s < 90:
        return f"{sign}{s:.0f} s"
    if s < 90 * 60:
        return f"{sign}{s / 60:.1f} min"
    if s < 48 * 3600:
        return f"{sign}{s / 3600:.1f} h"
    return f"{sign}{s / 86400:.1f} d"


def fmt_kg(kg: float | None) -> str:
    """Emissions in kg CO₂e (g below one kilogram)."""
    if kg is None:
        return "—"
    if abs(kg) < 1:
        return f"{kg * 1000:.0f} g CO₂e"
    return f"{kg:,.2f} kg CO₂e"


def fmt_kwh(kwh: float | None) -> str:
    """Energy in kWh (Wh below one kilowatt-hour)."""
    if kwh is None:
        return "—"
    if abs(kwh) < 1:
        return f"{kwh * 1000:.0f} Wh"
    return f"{kwh:,.2f} kWh"


def fmt_intensity(g_per_kwh: float | None) -> str:
    """Carbon intensity in g CO₂e/kWh."""
    return "—" if g_per_kwh is None else f"{g_per_kwh:,.0f} g CO₂e/kWh"


def fmt_number(value: float | None, unit: str = "", digits: int = 0) -> str:
    """A number with thousands separators and its unit."""
    if value is None:
        return "—"
    text = f"{value:,.{digits}f}"
    return f"{text} {unit}".strip()


def fmt_pct(value: float | None, digits: int = 0) -> str:
    """A percentage."""
    return "—" if value is None else f"{value:.{digits}f} %"


def state_badge(state: str) -> Markup:
    """A job state as a coloured badge."""
    return Markup('<span class="badge state-{cls}">{state}</span>').format(
        cls=escape(state.lower()), state=state
    )


FILTERS = {
    "time": fmt_time,
    "duration": fmt_duration_s,
    "kg": fmt_kg,
    "kwh": fmt_kwh,
    "intensity": fmt_intensity,
    "num": fmt_number,
    "pct": fmt_pct,
    "state_badge": state_badge,
}
