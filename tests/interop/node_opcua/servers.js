"use strict";
// node-opcua servers for tests/handlers/test_opcua_interop.py: a local discovery server
// (node-opcua-server-discovery, no mDNS) and plain servers (node-opcua-server), some of them
// registering with it (RegisterServer over a secure channel with their own certificates).
//
//   node servers.js '{"pki": "/tmp/pki", "lds": {"port": 48600},
//                     "servers": [{"name": "A", "port": 48601, "register": true}]}'
//
// prints "ready <name> <url>" for each once it listens, then runs until killed.
const path = require("path");
const { OPCUACertificateManager } = require("node-opcua-certificate-manager");
const { OPCUAServer, RegisterServerMethod } = require("node-opcua-server");
const { OPCUADiscoveryServer } = require("node-opcua-server-discovery");

function certificates(pki, name) {
    return new OPCUACertificateManager({
        rootFolder: path.join(pki, name.replace(/[^A-Za-z0-9]/g, "_")),
        automaticallyAcceptUnknownCertificate: true,
    });
}

async function main() {
    const spec = JSON.parse(process.argv[2]);
    if (spec.lds) {
        const lds = new OPCUADiscoveryServer({
            port: spec.lds.port,
            hostname: "127.0.0.1",
            serverCertificateManager: certificates(spec.pki, "lds"),
            serverInfo: {
                applicationUri: "urn:akri-py:interop:lds",
                productUri: "urn:akri-py:interop",
                applicationName: { text: "node-opcua LDS" },
            },
        });
        await lds.start();
        console.log(`ready LDS opc.tcp://127.0.0.1:${spec.lds.port}`);
    }
    await Promise.all(
        spec.servers.map(async (item) => {
            const server = new OPCUAServer({
                port: item.port,
                hostname: "127.0.0.1",
                serverCertificateManager: certificates(spec.pki, item.name),
                serverInfo: {
                    applicationUri: `urn:akri-py:interop:${item.name}`,
                    productUri: "urn:akri-py:interop",
                    applicationName: { text: item.name },
                },
                registerServerMethod: item.register ? RegisterServerMethod.LDS : RegisterServerMethod.HIDDEN,
                discoveryServerEndpointUrl: item.register ? `opc.tcp://127.0.0.1:${spec.lds.port}` : undefined,
            });
            await server.start();
            console.log(`ready ${item.name} ${server.getEndpointUrl()}`);
        }),
    );
}

main().catch((error) => {
    console.error(error);
    process.exit(1);
});
