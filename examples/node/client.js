#!/usr/bin/env node
// A Baton client in Node: streams one generation from a gateway and prints its text as
// it arrives (usage and why it stopped go to stderr).
//
//   npm ci
//   node client.js 127.0.0.1:50051 "The capital of France is" [--max-tokens 32]
//       [--temperature 0] [--api-key KEY] [--tls-ca ca.pem]
//
// It loads the public API's .proto at run time (@grpc/proto-loader), so nothing is
// generated; a copy of protos/ next to it works as well as this checkout's (--protos).

"use strict";

const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const USAGE = 'usage: node client.js HOST:PORT PROMPT [--max-tokens N] [--temperature T] '
  + '[--api-key KEY] [--tls-ca FILE] [--protos DIR]';

function parseArgs(argv) {
  const options = {
    maxTokens: 32,
    temperature: undefined,  // the server's default (1.0)
    apiKey: "",
    tlsCa: "",
    protos: path.join(__dirname, "..", "..", "protos"),
  };
  const positional = [];
  for (let i = 0; i < argv.length; i++) {
    const flag = { "--max-tokens": "maxTokens", "--temperature": "temperature", "--api-key": "apiKey",
      "--tls-ca": "tlsCa", "--protos": "protos" }[argv[i]];
    if (flag === undefined) {
      positional.push(argv[i]);
    } else if (i + 1 < argv.length) {
      options[flag] = argv[++i];
    } else {
      throw new Error(`${argv[i]} needs a value`);
    }
  }
  if (positional.length !== 2) throw new Error(USAGE);
  [options.address, options.prompt] = positional;
  options.maxTokens = Number(options.maxTokens);
  if (options.temperature !== undefined) options.temperature = Number(options.temperature);
  return options;
}

function generationClient(options) {
  const definition = protoLoader.loadSync("baton/v1/generation.proto", {
    includeDirs: [options.protos],
    keepCase: true, // field names as in the .proto: max_tokens, finish_reason
    enums: String, // FINISH_REASON_STOP, not 1
    longs: String,
    defaults: true,
    oneofs: true,
  });
  const Generation = grpc.loadPackageDefinition(definition).baton.v1.Generation;
  const credentials = options.tlsCa
    ? grpc.credentials.createSsl(fs.readFileSync(options.tlsCa))
    : grpc.credentials.createInsecure();
  return new Generation(options.address, credentials);
}

function main() {
  let options;
  try {
    options = parseArgs(process.argv.slice(2));
  } catch (error) {
    console.error(error.message);
    process.exit(2);
  }
  const client = generationClient(options);
  const metadata = new grpc.Metadata();
  if (options.apiKey) metadata.set("authorization", `Bearer ${options.apiKey}`);
  const sampling = { max_tokens: options.maxTokens };
  if (options.temperature !== undefined) sampling.temperature = options.temperature;

  const call = client.GenerateStream({ text: options.prompt, sampling }, metadata,
    { deadline: Date.now() + 120_000 });
  call.on("data", (message) => {
    process.stdout.write(message.text);
    if (message.finish_reason !== "FINISH_REASON_UNSPECIFIED" && message.usage) {
      const { prompt_tokens, completion_tokens } = message.usage;
      console.error(`[${message.finish_reason}: ${prompt_tokens} prompt, ${completion_tokens} generated tokens]`);
    }
  });
  call.on("error", (error) => {
    // A grpc status: UNAVAILABLE (no gateway there), INVALID_ARGUMENT (its details
    // name the field), RESOURCE_EXHAUSTED (overloaded: retry later), ...
    console.error(`${grpc.status[error.code]}: ${error.details}`);
    process.exitCode = 1;
  });
  call.on("status", (status) => {
    if (status.code === grpc.status.OK) process.stdout.write("\n");
    client.close();
  });
}

main();
