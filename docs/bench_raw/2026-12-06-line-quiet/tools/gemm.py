import torch,time
torch.set_num_threads(1)
a=torch.randn(512,768);b=torch.randn(768,3072)
for _ in range(3): a@b
t=time.perf_counter();n=0
while time.perf_counter()-t<2: a@b;n+=1
print("GFLOP/s", round(2*512*768*3072*n/(time.perf_counter()-t)/1e9,1))
