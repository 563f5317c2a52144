export PYTHONPATH=src
for m in qwen3-30b-a3b llama-3-8b phi-4 qwen3-32b; do
  mkdir -p $OUT/$m
  OUT=$OUT/$m SHAPE=$m PROMPTS=128 RATES=inf PEER_PROMPTS=0 timeout 150 bash bench/serving_gpu.sh 2>&1 | grep -E "^blink +(isolated|colocated)|blink @|healthy|exited" 
done
