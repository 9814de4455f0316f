# Sourced by the GPU-machine scripts: install the carried wheels (.whl/, see
# ../shared/device/fetch-wheels.sh) beside the image's packages and put the repo's packages on
# the path. Sets $out (results, default $OUT). fastapi 0.165 and later import two packages the
# image lacks, so fetch them too: fetch-wheels.sh opentelemetry-api annotated-doc
# (the server would not start on the twenty-second run without them).
out=${OUT:-out/device}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:):${PYTHONPATH:-}
export PATH=/tmp/site/bin:$PATH
# a stage cut off by its time limit still leaves its log (a cold engine start left none)
export PYTHONUNBUFFERED=1
