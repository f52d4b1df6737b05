"""The operator web console: server-rendered pages at /console (Jinja2, htmx, uPlot)."""
