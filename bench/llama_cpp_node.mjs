// llama.cpp as a peer (bench/llama_cpp.py drives it): the prebuilt library the npm package node-llama-cpp
// ships, on the very GGUF file and the very token ids csd-serve decodes, greedy, timed with prefill.
// argv: MODEL.gguf THREADS. Then one JSON request a line on stdin, {"ids": [...], "max_tokens": n,
// "lookup": bool}, and one JSON answer a line on stdout, {"tokens": [...], "seconds": s,
// "first_token_seconds": s, "predictions": {used, unused, validated, refuted}}. A first line {"ready": ...}
// says the model is loaded.
import readline from "node:readline";

// NODE_LLAMA_CPP: the package's entry file where it lies outside node's own search path (ES modules ignore
// NODE_PATH), as `make peer-llama-cpp` installs it under .peers/
const {getLlama, InputLookupTokenPredictor} = await import(process.env.NODE_LLAMA_CPP ?? "node-llama-cpp");

const [modelPath, threads] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({threads: Number(threads), contextSize: 4096, sequences: 1});
const stops = new Set([model.tokens.eos, model.tokens.eot].filter((t) => t != null));
process.stdout.write(JSON.stringify({ready: true, build: llama.buildType, cpu: llama.cpuMathCores ?? null}) + "\n");

for await (const line of readline.createInterface({input: process.stdin})) {
    if (!line.trim()) continue;
    const request = JSON.parse(line);
    // a fresh sequence each request: nothing cached from the one before, as csd-serve runs each prompt
    // alone. The input-lookup predictor drafts from the prompt (prompt lookup decoding); it looks only in
    // the tokens given to `updateInputTokens`, which node-llama-cpp's chat and completion classes call and a
    // bare `sequence.evaluate` does not: without this call it predicted nothing ("0 predictions used")
    const predictor = request.lookup ? new InputLookupTokenPredictor() : null;
    predictor?.updateInputTokens(request.ids);
    const sequence = context.getSequence(predictor ? {tokenPredictor: predictor} : {});
    const tokens = [];
    const started = performance.now();
    let first = null;
    for await (const token of sequence.evaluate(request.ids, {temperature: 0})) {
        if (first === null) first = (performance.now() - started) / 1000;
        tokens.push(token);
        if (stops.has(token) || tokens.length >= request.max_tokens) break;
    }
    const seconds = (performance.now() - started) / 1000;
    const predictions = sequence.tokenPredictions;
    sequence.dispose();
    process.stdout.write(JSON.stringify({tokens, seconds, first_token_seconds: first, predictions}) + "\n");
}
await context.dispose();
await model.dispose();
