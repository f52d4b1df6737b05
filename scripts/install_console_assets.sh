#!/usr/bin/env bash
# Install the console's pinned front-end libraries (package-lock.json) from the npm registry and
# copy the files the console serves into scheduler_service/console/static/vendor/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v npm >/dev/null 2>&1; then
  echo "error: npm is not installed; install Node.js and npm, then run $0 again" >&2
  exit 1
fi

npm ci --ignore-scripts --no-audit --no-fund --loglevel=error

vendor=scheduler_service/console/static/vendor
rm -rf "$vendor"
mkdir -p "$vendor"
cp node_modules/htmx.org/dist/htmx.min.js "$vendor/htmx.min.js"
cp node_modules/uplot/dist/uPlot.iife.min.js "$vendor/uPlot.iife.min.js"
cp node_modules/uplot/dist/uPlot.min.css "$vendor/uPlot.min.css"
# Swagger UI for the API docs at /docs, served from here rather than a CDN.
cp node_modules/swagger-ui-dist/swagger-ui-bundle.js "$vendor/swagger-ui-bundle.js"
cp node_modules/swagger-ui-dist/swagger-ui.css "$vendor/swagger-ui.css"
cp node_modules/swagger-ui-dist/favicon-32x32.png "$vendor/swagger-favicon-32x32.png"
# Keep each library's licence next to its files.
cp node_modules/htmx.org/LICENSE "$vendor/htmx.LICENSE"
cp node_modules/uplot/LICENSE "$vendor/uPlot.LICENSE"
cp node_modules/swagger-ui-dist/LICENSE "$vendor/swagger-ui.LICENSE"
# Record the installed versions; the console shows them and checks the files are there.
node -e '
const v = (p) => require("./node_modules/" + p + "/package.json").version;
process.stdout.write(JSON.stringify({"htmx.org": v("htmx.org"), "uplot": v("uplot"), "swagger-ui-dist": v("swagger-ui-dist")}, null, 2) + "\n");
' > "$vendor/versions.json"
echo "console assets installed in $vendor: $(tr -d '\n ' < "$vendor/versions.json")"
