set -u
R=$PWD; OUT0=$OUT
OUT=$OUT0/ab DUMP=1 ROUNDS=1 BENCH_ARGS="--preset decode --variants decode --repeats 10 --warmup 2" BENCH_TIMEOUT=150 \
  A_WHEEL=$(ls $R/.whl_A/*.whl) B_WHEEL=$(ls $R/.whl_D/*.whl) bash scripts/ab_builds.sh
grep -c "^same" $OUT0/ab/compare.txt; grep -v "^same" $OUT0/ab/compare.txt
for b in A1 B1; do echo "== decode $b"; grep -E "decode" $OUT0/ab/bench_$b.log | grep -E "us|median" | head -12; done
S=$(mktemp -d); python3 -m pip install -q --no-deps --no-index --target $S $R/.whl_D/*.whl
export PYTHONPATH=$S XLA_PYTHON_CLIENT_PREALLOCATE=false
for tool in memcheck racecheck; do
  (cd /tmp && timeout 150 compute-sanitizer --tool $tool --kernel-name kns=jax_kdakernels --error-exitcode 9 python3 $R/scripts/sanitizer_case.py) > $OUT0/san_$tool.log 2>&1; echo "$tool exit $?"; tail -2 $OUT0/san_$tool.log
done
(cd /tmp && timeout 60 python3 $R/benchmarks/heuristic_grid.py --seqs 1 --heads 72,80 --out $OUT0/grid-67-82-n1.json) 2>&1 | grep "N="
(cd /tmp && timeout 60 python3 $R/benchmarks/heuristic_grid.py --seqs 4 --heads 18,20 --out $OUT0/grid-67-82-n4.json) 2>&1 | grep "N="
(cd /tmp && timeout 200 python3 -m jax_kda.bench --preset throughput --seqlen 8192 --heads 24,12 --variants prepare,total --total-block-v auto,baseline --repeats 10 --out $OUT0/bench --no-progress --no-plot) > $OUT0/throughput.log 2>&1; echo "throughput exit $?"; grep -E "total|prepare" $OUT0/throughput.log | tail -30
cd $OUT0 && tar czf logs.tgz ab/*.log ab/compare.txt *.log && rm -f ab/*.log
