import time, torch, sys
from pdserve import LLM, SamplingParams
torch.set_num_threads(2)
m="/root/.cache/pdserve/models/gguf-SmolLM2-135M-Instruct.Q4_1-a81b0b986a7f"
llm=LLM(m, max_num_seqs=8, progress=False)
eng=llm.engine
g=torch.Generator().manual_seed(0)
V=eng.model_config.vocab_size
prompts=[torch.randint(10,V,(256,),generator=g).tolist() for _ in range(64)]
sp=SamplingParams(temperature=0.0,max_tokens=64,ignore_eos=True,detokenize=False)
llm.generate(prompts[:8], sp)  # warm
def waves():
    t=time.perf_counter(); outs=llm.generate(prompts[8:56], sp); return 48*64/(time.perf_counter()-t)
def staggered():
    # keep 8 in flight; the first 8 start with staggered lengths so later arrivals are spread out
    nxt=8; done=0; toks=0; t=time.perf_counter(); rid=0
    for i in range(8):
        eng.add_request(f"s{rid}", prompts[8+i], SamplingParams(temperature=0.0,max_tokens=8*(i+1),ignore_eos=True,detokenize=False)); rid+=1
    live=8; started=0
    while live:
        for o in eng.step():
            if o.finished:
                toks+=len(o.outputs[0].token_ids); live-=1
                if started<40:
                    eng.add_request(f"s{rid}", prompts[16+started], sp); rid+=1; started+=1; live+=1
    return toks/(time.perf_counter()-t)
for f in (waves, staggered, waves, staggered):
    print(f.__name__, round(f(),1), flush=True)
